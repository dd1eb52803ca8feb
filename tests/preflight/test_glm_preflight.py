"""Preflight of a GLM-4.5 (glm4_moe) model directory: a tiny one passes `config validate` with EP 2 and R3; a
config.json the family cannot train is one line naming the key and value, exit 2, before Ray starts (the recipe
tiny_glm.yaml, a model.tiny, passes in tests/test_preflight.py; every refusal's wording is checked without the CLI
in tests/trainer/test_family_glm4_moe.py)."""
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gspo_ray.cli import app
from gspo_ray.models.tiny import make_tiny_model


def _job_file(tmp_path, model: dict, trainer: dict | None = None) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"copy:{n}=", "reference": str(n)}) + "\n" for n in (12, 345)))
    job = {"name": "glm", "logging": {"out_dir": str(tmp_path / "runs")}, "data": {"source": "jsonl", "path": str(data)},
           "rollout": {"max_new_tokens": 6, "max_model_len": 64}, "model": model, "trainer": trainer or {}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return tmp_path / "job.yaml"


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return make_tiny_model("glm4_moe", tmp_path_factory.mktemp("glm") / "model", layers=3, init_std=0.3)


def test_a_tiny_glm_directory_passes(tmp_path, glm_dir):
    job = _job_file(tmp_path, {"path": str(glm_dir)}, {"num_workers": 2, "ep": 2, "routing_replay": "R3"})
    result = CliRunner().invoke(app, ["config", "validate", str(job)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("change,expected", [
    ({"n_group": 2, "topk_group": 2}, "n_group 2 / topk_group 2 with num_experts_per_tok 2 is not supported"),
])
def test_a_glm_config_the_family_cannot_train_stops_in_one_line(tmp_path, glm_dir, change, expected):
    model = tmp_path / "model"
    model.mkdir()
    for f in Path(glm_dir).iterdir():
        (model / f.name).symlink_to(f)
    cfg = json.loads((Path(glm_dir) / "config.json").read_text()) | change
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps(cfg))
    tmp = tmp_path / "job"
    tmp.mkdir()
    result = CliRunner().invoke(app, ["config", "validate", str(_job_file(tmp, {"path": str(model)}))])
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert err.startswith("error: ") and expected in err and "config.json" in err and len(err.splitlines()) == 1, err
