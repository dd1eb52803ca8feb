"""The run directory before a job starts (no Ray): an existing run is not overwritten without --fresh, the config
copy on shared storage carries no secrets, and `name` cannot point the run directory elsewhere."""
from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from gspo_ray.cli import app
from gspo_ray.config import ConfigError, load_config
from gspo_ray.coordinator.run_dir import REDACTED, RunDirError, prepare_run_dir

RECIPE = "gspo_ray/recipes/tiny_moe.yaml"


def _cfg(tmp_path, *overrides):
    return load_config(RECIPE, [f"logging.out_dir={tmp_path}", *overrides])


def _old_run(cfg):
    (cfg.run_dir / "checkpoints" / "step_000010").mkdir(parents=True)
    (cfg.run_dir / "metrics.jsonl").write_text('{"step": 10}\n')
    (cfg.run_dir / "model").mkdir()  # inputs (the built tiny model) are kept by --fresh


def test_train_over_an_existing_run_needs_resume_or_fresh(tmp_path):
    cfg = _cfg(tmp_path)
    _old_run(cfg)
    res = CliRunner().invoke(app, ["train", RECIPE, f"logging.out_dir={tmp_path}"])
    assert res.exit_code == 2, res.output
    (line,) = res.output.strip().splitlines()  # one line, naming the way out, before anything started
    assert "already holds a run (checkpoints, metrics.jsonl)" in line and "--fresh" in line
    assert (cfg.run_dir / "metrics.jsonl").exists()
    res = CliRunner().invoke(app, ["train", RECIPE, f"logging.out_dir={tmp_path}", "--resume", "--fresh"])
    assert res.exit_code == 2 and "exclude each other" in res.output

    prepare_run_dir(cfg, resume=False, fresh=True)
    assert sorted(p.name for p in cfg.run_dir.iterdir()) == ["config.yaml", "model"]
    prepare_run_dir(cfg, resume=False, fresh=False)  # an empty (or new) run directory needs no flag


def test_config_copy_redacts_secrets(tmp_path):
    cfg = _cfg(tmp_path, "cluster.runtime_env={env_vars: {HF_TOKEN: hf_abc, WANDB_API_KEY: wk, OMP_NUM_THREADS: '2',"
                         " AWS_SECRET_ACCESS_KEY: aws}, pip: ['--index-url https://bob:pw123@pypi.example/simple']}",
               "rollout.reward.kwargs={api_key: sk-1, judgeAuth: {Authorization: Bearer xyz}, max_tokens: 8}",
               "rollout.agent={fn: 'my_agents:solve', kwargs: {openai_api_key: sk-agent, search: {token: tk9}, "
               "max_calls: 2}}")
    prepare_run_dir(cfg, resume=False, fresh=False)
    text = (cfg.run_dir / "config.yaml").read_text()
    for secret in ("hf_abc", "wk", "aws", "pw123", "sk-1", "xyz", "sk-agent", "tk9"):
        assert secret not in text, secret
    copy = yaml.safe_load(text)
    env = copy["cluster"]["runtime_env"]["env_vars"]
    assert env == {"HF_TOKEN": REDACTED, "WANDB_API_KEY": REDACTED, "OMP_NUM_THREADS": "2",
                   "AWS_SECRET_ACCESS_KEY": REDACTED}  # non-secrets stay: the copy still documents the run
    assert copy["cluster"]["runtime_env"]["pip"] == [f"--index-url https://{REDACTED}@pypi.example/simple"]
    assert copy["rollout"]["reward"]["kwargs"] == {"api_key": REDACTED, "judgeAuth": REDACTED, "max_tokens": 8}
    assert copy["rollout"]["reward"]["fn"] == cfg.rollout.reward.fn
    assert copy["rollout"]["agent"]["kwargs"] == {"openai_api_key": REDACTED, "search": {"token": REDACTED},
                                                  "max_calls": 2}
    assert cfg.cluster.runtime_env["env_vars"]["HF_TOKEN"] == "hf_abc"  # the job itself still gets the value


@pytest.mark.parametrize("name", ["../escape", "a/b", "/abs", "..", ".", "a\\b", ""])
def test_name_cannot_leave_the_output_directory(tmp_path, name):
    with pytest.raises(ConfigError, match=r"name: (Value error, )?must be one directory name"):
        _cfg(tmp_path, f"name={name!r}")


def test_guarded_before_expensive_work(tmp_path):
    cfg = _cfg(tmp_path)
    _old_run(cfg)
    with pytest.raises(RunDirError):
        prepare_run_dir(cfg, resume=False, fresh=False)
    assert not (cfg.run_dir / "config.yaml").exists()  # nothing written either


def _legacy_checkpoint(cfg, world_size: int, distributed: bool):
    """A checkpoint of the older layout (no "format" in meta.json): every rank a full model + optimizer replica."""
    import torch

    from gspo_ray.coordinator.checkpoint import CheckpointManager
    from gspo_ray.coordinator.loop import LoopState
    from gspo_ray.trainer.checkpoints.checkpoint import save_checkpoint

    w = torch.ones(4, 3)
    main = w.reshape(-1)[:6].clone() if distributed else w.clone()  # a distributed optimizer's flat slice
    payload = {"model": {"w": w}, "optimizer": [{"inner": {}, "main_params": [main], "grad_scaler": None}]}
    meta = {"world_size": world_size, "tp": 1, "ep": 1, "version": 3, "layouts": [{}] * world_size}
    CheckpointManager(cfg.run_dir).save(LoopState(step=3, version=3), lambda d: save_checkpoint(d, 0, payload, meta))
    (cfg.run_dir / "metrics.jsonl").write_text('{"step": 3}\n')


@pytest.mark.parametrize("workers, distributed, saved_distributed, problem", [
    (2, None, False, "plain-optimizer state; this trainer uses the distributed optimizer"),  # the new DP 2 default
    (2, "true", True, "world size 1; this trainer has 2 ranks"),
    (2, "false", False, None),   # a plain optimizer's replica loads at any DP size
    (1, None, False, None),      # DP 1: the plain optimizer, as saved
])
def test_resume_from_the_older_checkpoint_layout(tmp_path, workers, distributed, saved_distributed, problem):
    overrides = [f"trainer.num_workers={workers}"]
    if distributed is not None:
        overrides.append(f"trainer.use_distributed_optimizer={distributed}")
    cfg = _cfg(tmp_path, *overrides)
    _legacy_checkpoint(cfg, 1, saved_distributed)
    if problem is None:
        prepare_run_dir(cfg, resume=True, fresh=False)
        return
    with pytest.raises(RunDirError, match="older layout") as e:
        prepare_run_dir(cfg, resume=True, fresh=False)
    assert problem in str(e.value) and "step_000003" in str(e.value) and "\n" not in str(e.value)
    res = CliRunner().invoke(app, ["train", RECIPE, f"logging.out_dir={tmp_path}", "--resume", *overrides])
    assert res.exit_code == 2 and "older layout" in res.output and len(res.output.strip().splitlines()) == 1
