"""Secrets never reach W&B: the run config a job hands to `wandb.init` is the redacted one (the same redaction
as the run directory's config.yaml). Planted secrets in `cluster.runtime_env` env vars, `rollout.reward.kwargs`
and a URL's user:password are looked for in what the tracker gets and, with the wandb package, in every file of
an offline W&B run."""
from __future__ import annotations

import json

import pytest

from gspo_ray.config import load_config
from gspo_ray.coordinator.run_dir import REDACTED, redacted_config_dict

SECRETS = ("hf_PLANTEDtoken0123456789", "wandbkey-PLANTED-42", "s3cr3t-PLANTED-pw")


def _cfg(tmp_path, *extra):
    return load_config("gspo_ray/recipes/tiny_moe.yaml", [
        f"logging.out_dir={tmp_path}", "logging.progress=false",
        f"cluster.runtime_env.env_vars.HF_TOKEN={SECRETS[0]}",
        f"cluster.runtime_env.env_vars.WANDB_API_KEY={SECRETS[1]}",
        "cluster.runtime_env.env_vars.OMP_NUM_THREADS=2",
        f"rollout.reward.kwargs.api_key={SECRETS[2]}",
        f"rollout.reward.kwargs.endpoint=https://user:{SECRETS[2]}@judge.example/v1", *extra])


def test_the_tracker_config_holds_no_secret(tmp_path):
    run_config = redacted_config_dict(_cfg(tmp_path))
    text = json.dumps(run_config)
    for secret in SECRETS:
        assert secret not in text
    env = run_config["cluster"]["runtime_env"]["env_vars"]
    assert env["HF_TOKEN"] == env["WANDB_API_KEY"] == REDACTED and str(env["OMP_NUM_THREADS"]) == "2"  # still documents
    assert run_config["rollout"]["reward"]["kwargs"]["endpoint"] == f"https://{REDACTED}@judge.example/v1"


def test_offline_wandb_files_hold_no_secret(tmp_path, monkeypatch):
    """Also the command line: W&B records sys.argv, where `key=value` overrides can carry a secret."""
    pytest.importorskip("wandb")
    from gspo_ray.coordinator.tracking import MetricsTracker

    monkeypatch.setattr("sys.argv", ["gspo-ray", "train", "job.yaml",
                                     f"cluster.runtime_env.env_vars.HF_TOKEN={SECRETS[0]}"])

    cfg = _cfg(tmp_path, "logging.wandb.mode=offline", "logging.tensorboard=false")
    run_dir = cfg.run_dir
    tracker = MetricsTracker(run_dir, 2, 0, tensorboard=False, progress=False, wandb=cfg.logging.wandb,
                             run_config=redacted_config_dict(cfg))
    tracker.log(1, {"rollout/reward_mean": 0.5})
    tracker.close()
    files = [p for p in (run_dir / "wandb").rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files), files  # the offline run was written
    blob = b"".join(p.read_bytes() for p in files)
    assert b"OMP_NUM_THREADS" in blob  # the config reached W&B ...
    for secret in SECRETS:
        assert secret.encode() not in blob, secret  # ... without its secrets
