"""gpt-oss (trainer/families/gpt_oss.py) against what transformers and vLLM run: its RoPE is read as transformers'
GptOssConfig reads a config.json (the released checkpoints' `rope_scaling` beside a top-level `rope_theta`, or
neither key: GptOssConfig's YaRN factor 32, theta 150000), and what vLLM's gpt-oss cannot run stops in the
preflight, one line naming the config.json key or the job field, exit 2 (`config validate`)."""
import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from gspo_ray.cli import app
from gspo_ray.trainer.families import FAMILIES
from gspo_ray.trainer.model_spec import spec_from_hf_config

# the released gpt-oss-20b config.json's RoPE keys (transformers 4.x spelling), on a tiny model
RELEASED_ROPE = {"rope_theta": 150000, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                         "original_max_position_embeddings": 4096,
                                                         "rope_type": "yarn", "truncate": False}}
CONFIG = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": 64,
          "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32,
          "num_hidden_layers": 2, "vocab_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
          "sliding_window": 4, "max_position_embeddings": 4096}


def _validate(tmp_path, config: dict, trainer: dict | None = None):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "copy:12=", "reference": "12"}) + "\n")
    job = {"name": "oss", "logging": {"out_dir": str(tmp_path / "runs")}, "data": {"source": "jsonl", "path": str(data)},
           "rollout": {"max_new_tokens": 6, "max_model_len": 64}, "model": {"path": str(model)},
           "trainer": trainer or {}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return CliRunner().invoke(app, ["config", "validate", str(tmp_path / "job.yaml")])


@pytest.mark.parametrize("rope", [RELEASED_ROPE, {}], ids=["rope_scaling", "neither_key"])
def test_the_trainers_yarn_is_the_one_transformers_reads_from_the_config(rope):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    spec = spec_from_hf_config(CONFIG | rope, "m")
    hf = GptOssConfig.from_dict(CONFIG | rope)
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["factor"] == 32.0
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    inv_freq, factor = FAMILIES["gpt_oss"].rotary_override(spec)
    assert spec.extra["rope_theta"] == 150000.0 and torch.equal(inv_freq, want)
    assert factor == pytest.approx(want_factor, rel=1e-12) and factor > 1.3


@pytest.mark.parametrize("rope,expected", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
     "config.json: rope_parameters.rope_type 'default' is not supported with gpt_oss (only yarn"),
    ({"rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0,
                                             "original_max_position_embeddings": 4096, "beta_fast": 32.0}},
     "config.json: rope_scaling.rope_type 'yarn' without rope_scaling.beta_slow"),
])
def test_a_rope_vllms_gpt_oss_cannot_run_stops_in_one_line(tmp_path, rope, expected):
    result = _validate(tmp_path, CONFIG | rope)
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert err.startswith("error: ") and expected in err and len(err.splitlines()) == 1, err


GPUS = ["rollout.num_gpus_per_worker=1", "trainer.num_gpus_per_worker=1"]


@pytest.mark.parametrize("overrides,expected", [
    (GPUS, "rollout.weight_transfer nccl (auto resolves to nccl on CUDA) cannot push gpt_oss"),
    (["rollout.num_gpus_per_worker=0.5", "trainer.num_gpus_per_worker=0.5", "coordinator.mode=sync",
      "algorithm.eps=fixed"],
     "rollout.weight_transfer ipc (auto resolves to ipc on CUDA) cannot push gpt_oss"),
    (GPUS + ["rollout.weight_transfer=nccl"], "rollout.weight_transfer nccl cannot push gpt_oss"),
    (["trainer.use_te=true"], "trainer.use_te true is not built for gpt_oss"),
])
def test_a_path_the_family_has_not_built_is_refused_by_the_preflight(overrides, expected):
    """vLLM's nccl / ipc senders send the planned per-expert tensors, not gpt-oss's fused ones (what CUDA's auto
    picks would fail at the first push); Transformer Engine's grouped experts have no name rule for their biases."""
    from gspo_ray.config import load_config
    from gspo_ray.preflight.job_model import check_tiny_config
    from gspo_ray.preflight.model import PreflightError

    recipe = Path(__file__).resolve().parents[2] / "gspo_ray" / "recipes" / "tiny_gpt_oss.yaml"
    with pytest.raises(PreflightError) as err:
        check_tiny_config(load_config(recipe, overrides), on_cpu=True)
    assert expected in str(err.value) and "\n" not in str(err.value)
    check_tiny_config(load_config(recipe, []), on_cpu=True)  # CPU's auto: the trainer's export, local layers
    # trainer.use_te auto on CUDA resolves to true: gpt_oss builds the local spec, a family with TE names the TE one
    assert not FAMILIES["gpt_oss"].builds_te_layers(True) and FAMILIES["qwen3_moe"].builds_te_layers(True)
