"""Preflight of a GLM-4.5 (glm4_moe) model: a tiny one passes `config validate` (as a model.tiny and as a directory);
a config.json the family cannot train is one line naming the key and value, exit 2, before Ray starts."""
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


def test_a_tiny_glm_passes_as_model_tiny_and_as_a_directory(tmp_path, glm_dir):
    for i, model in enumerate(({"tiny": {"arch": "glm4_moe", "layers": 3, "init_std": 0.3}}, {"path": str(glm_dir)})):
        (tmp_path / str(i)).mkdir()
        job = _job_file(tmp_path / str(i), model, {"num_workers": 2, "ep": 2, "routing_replay": "R3"})
        result = CliRunner().invoke(app, ["config", "validate", str(job)])
        assert result.exit_code == 0, (model, result.output)


@pytest.mark.parametrize("change,expected", [
    ({"norm_topk_prob": False}, "norm_topk_prob False with num_experts_per_tok 2 is not supported"),
    ({"n_group": 2, "topk_group": 2}, "n_group 2 / topk_group 2 with num_experts_per_tok 2 is not supported"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
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
