"""Preflight of hybrid Gated DeltaNet / softmax models (qwen3_next; trainer/families/hybrid.py): no family takes
them yet, so every config.json stops in one line, exit 2, before Ray starts: a consistent one says what is built
and what is not; one whose layer pattern, head counts or sizes contradict each other, or that names a layer kind
not implemented, names the config.json key first."""
import json

import pytest
import yaml
from typer.testing import CliRunner

from gspo_ray.cli import app

CONFIG = {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 64,
          "hidden_size": 32, "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
          "full_attention_interval": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "partial_rotary_factor": 0.25, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
          "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "hidden_act": "silu"}


@pytest.mark.parametrize("change,expected", [
    ({}, "model_type 'qwen3_next' (hybrid Gated DeltaNet / softmax attention) is not supported yet"),
    ({"num_hidden_layers": 5}, "layer_types has 4 entries for num_hidden_layers 5"),
    ({"full_attention_interval": 2}, "layer_types and full_attention_interval 2 state different layer patterns"),
    ({"layer_types": ["linear_attention", "kimi_delta_attention", "linear_attention", "full_attention"]},
     "layer_types[1] 'kimi_delta_attention' is not implemented"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
    ({"linear_key_head_dim": 0}, "linear_key_head_dim is 0; expected a positive integer"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"partial_rotary_factor": 0.1}, "partial_rotary_factor 0.1 rotates 1 of head_dim 16"),
])
def test_a_hybrid_config_stops_in_one_line_naming_the_key(tmp_path, change, expected):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG | change))
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "copy:12=", "reference": "12"}) + "\n")
    job = {"name": "hybrid", "logging": {"out_dir": str(tmp_path / "runs")},
           "data": {"source": "jsonl", "path": str(data)}, "rollout": {"max_new_tokens": 6, "max_model_len": 64},
           "model": {"path": str(model)}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    result = CliRunner().invoke(app, ["config", "validate", str(tmp_path / "job.yaml")])
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert err.startswith("error: ") and expected in err and "config.json" in err and len(err.splitlines()) == 1, err
