"""The run directory before a job starts: refuse to mix a fresh run into an old one, and write the config copy
with secrets redacted.

    prepare_run_dir(cfg, resume=False, fresh=False)   # raises RunDirError (exit 2 in the CLI) before any work
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

from gspo_ray.config import JobConfig
from gspo_ray.config.secrets import REDACTED, is_secret_key, redact_url  # noqa: F401 - REDACTED: the marker's home for callers
from gspo_ray.coordinator.run_lock import check_unlocked

# Outputs of a run that a fresh start would silently mix with (metrics appended, checkpoints overwritten).
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tensorboard", "rollouts", "training.png", "eval", "wandb", "hf")


class RunDirError(ValueError):
    """The run directory holds another run's outputs and neither --resume nor --fresh was given."""


def check_run_dir(cfg: JobConfig, resume: bool, fresh: bool) -> list[str]:
    """The run outputs already in the run directory; RunDirError if they are there and neither flag is given."""
    if resume and fresh:
        raise RunDirError("--resume and --fresh exclude each other")
    check_unlocked(cfg.run_dir)  # a live job's directory is refused before anything is read or deleted
    found = [name for name in RUN_OUTPUTS if (cfg.run_dir / name).exists() or (cfg.run_dir / name).is_symlink()]
    if found and not resume and not fresh:
        raise RunDirError(f"{cfg.run_dir} already holds a run ({', '.join(found)}): pass --resume to continue it "
                          "or --fresh to delete its outputs and start over")
    if resume:
        check_resume_kind(cfg)
    return found


def check_resume_kind(cfg: JobConfig) -> None:
    """--resume: the run's latest checkpoint was trained as this run trains (LoRA with the same adapters, or the
    full model) and, when it has the older layout (a full replica per rank), can be loaded into this trainer
    layout; RunDirError (one line naming the checkpoint and what differs, exit 2 before Ray starts) otherwise."""
    import json

    from gspo_ray.config.lora import check_lora_kind
    from gspo_ray.coordinator.checkpoint import CheckpointError, CheckpointManager

    if not (cfg.run_dir / "checkpoints").is_dir():
        return
    try:
        latest = CheckpointManager(cfg.run_dir).latest()
    except CheckpointError:  # reported where the resume reads it
        return
    meta = latest / "trainer" / "meta.json" if latest is not None else None
    if meta is None or not meta.is_file():
        return
    saved = json.loads(meta.read_text())
    try:
        check_lora_kind(saved.get("lora"), cfg.trainer.lora, str(latest))
    except ValueError as e:
        raise RunDirError(str(e)) from None
    if saved.get("format") is None:  # the older layout (a full replica per rank): loaded only where it can be
        from gspo_ray.trainer.checkpoints.checkpoint import legacy_problem, legacy_was_distributed

        t = cfg.trainer
        problem = legacy_problem(saved, t.tp, t.ep, t.num_workers, t.distributed_optimizer,
                                 legacy_was_distributed(meta.parent), str(latest))
        if problem:
            raise RunDirError(problem)


def prepare_run_dir(cfg: JobConfig, resume: bool, fresh: bool) -> Path:
    """Check (and with `fresh`, clear) the run directory, then write the redacted config copy. The caller holds
    the run directory's lock (run_lock.RunLock) before this deletes anything."""
    run_dir = cfg.run_dir
    found = check_run_dir(cfg, resume, fresh)
    if fresh:
        for name in found:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(redacted_config(cfg))
    return run_dir


def redacted_config(cfg: JobConfig) -> str:
    """The effective config as YAML for the run directory (shared storage), secrets replaced by `<redacted>`.

    Redacted: values under `cluster.runtime_env` (env_vars and the rest), `rollout.reward.kwargs`,
    `rollout.multi_turn.kwargs` and `rollout.agent.kwargs` whose key looks like a secret (config/secrets.py), at any
    depth; and the user:password
    part of any URL anywhere in the config. Everything else is kept, so the copy still documents the run."""
    header = f"# effective config of this run; values of secret-looking keys are replaced by {REDACTED}\n"
    return header + yaml.safe_dump(redacted_config_dict(cfg), sort_keys=False)


def redacted_config_dict(cfg: JobConfig) -> dict:
    """The effective config as plain data with secrets redacted (see `redacted_config`): what leaves the job for
    shared storage or a tracker (the W&B run config)."""
    raw = cfg.model_dump(mode="json")
    raw["cluster"]["runtime_env"] = _redact_keys(raw["cluster"]["runtime_env"])
    rollout = raw["rollout"]
    rollout["reward"]["kwargs"] = _redact_keys(rollout["reward"]["kwargs"])
    for plugin in ("multi_turn", "agent"):  # an agent's kwargs often carry its own API keys
        if rollout.get(plugin):
            rollout[plugin]["kwargs"] = _redact_keys(rollout[plugin]["kwargs"])
    return _redact_urls(raw)


def _redact_keys(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: (REDACTED if is_secret_key(str(k)) and v not in (None, "") else _redact_keys(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_redact_keys(v) for v in node]
    return node


def _redact_urls(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _redact_urls(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_redact_urls(v) for v in node]
    if isinstance(node, str):
        return redact_url(node)
    return node
