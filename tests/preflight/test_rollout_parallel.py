"""Preflight of rollout.tensor_parallel_size / rollout.enable_expert_parallel (preflight/model.py:
check_engine_parallel): a TP that does not divide the heads or, with expert parallelism, the experts, or that
exceeds a node's devices, is one line naming the field and the numbers, exit 2, before Ray starts. Pure: the tiny
model's config, no engine."""
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gspo_ray.cli import app
from gspo_ray.config import RolloutConfig
from gspo_ray.models.tiny import build_config
from gspo_ray.preflight.model import PreflightError, check_engine_parallel


def _hf(arch="qwen3_moe", heads=4, experts=6):
    return build_config(arch, vocab_size=32, hidden=128, heads=heads, kv_heads=heads, experts=experts).to_dict()


@pytest.mark.parametrize("tp,ep,devices,expected", [
    (3, False, 8, "rollout.tensor_parallel_size (3) does not divide the model's 4 attention heads"),
    (4, True, 8, "rollout.tensor_parallel_size (4) does not divide the model's 6 experts"),
    (4, False, 2, "rollout.tensor_parallel_size (4) exceeds the 2 cores of a node"),
])
def test_bad_tensor_parallel_sizes_are_one_line(tp, ep, devices, expected):
    with pytest.raises(PreflightError) as e:
        check_engine_parallel("m", _hf(), tp, ep, devices, "core")
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_good_sizes_pass():
    check_engine_parallel("m", _hf(), 2, True, 2, "core")  # 4 heads, 6 experts
    check_engine_parallel("m", _hf(), 4, False, None, "GPU")  # experts sliced, not split: 6 is fine
    check_engine_parallel("m", _hf("qwen2", heads=2), 2, False, 2, "core")


def test_config_fields_are_documented_and_default_to_one_engine_device():
    cfg = RolloutConfig()
    assert cfg.tensor_parallel_size == 1 and cfg.enable_expert_parallel is False
    for name in ("tensor_parallel_size", "enable_expert_parallel"):
        assert RolloutConfig.model_fields[name].description
    with pytest.raises(ValueError):
        RolloutConfig(tensor_parallel_size=0)


def _job_file(tmp_path, rollout: dict):
    """A small jsonl job with these rollout fields, written as tmp_path/job.yaml."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"copy:{n}=", "reference": str(n)}) + "\n" for n in (12, 345)))
    job = {"name": "tp", "logging": {"out_dir": str(tmp_path / "runs")}, "data": {"source": "jsonl", "path": str(data)},
           "rollout": {"max_new_tokens": 6, "max_model_len": 64, **rollout}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return tmp_path / "job.yaml"


@pytest.mark.parametrize("rollout,expected", [
    ({"tensor_parallel_size": 3}, "rollout.tensor_parallel_size (3)"),
    ({"weight_transfer": "nccl"}, "rollout.weight_transfer 'nccl'"),  # CUDA transports with CPU engines
])
def test_train_stops_before_ray_naming_the_field(tmp_path, rollout, expected):
    result = CliRunner().invoke(app, ["train", str(_job_file(tmp_path, rollout))])
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert err.startswith("error: ") and expected in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["job.yaml", "train.jsonl"]  # nothing written


def test_the_engine_choice_is_in_the_jobs_first_lines(tmp_path):
    for tp, expected in ((1, "engines    ok       in-process"), (2, "engines    ok       multi-process")):
        job = _job_file(tmp_path, {"tensor_parallel_size": tp})
        result = CliRunner().invoke(app, ["config", "validate", str(job)])
        assert result.exit_code == 0 and expected in result.stdout, result.output
