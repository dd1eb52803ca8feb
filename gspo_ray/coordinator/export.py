"""HF model directories out of a run: at checkpoints during training (`logging.export_hf`) and after the fact.

    gspo-ray export runs/tiny-moe-gspo --out exported/ [--dtype bfloat16]      # the run's latest checkpoint
    gspo-ray export runs/tiny-moe-gspo/checkpoints/step_000100 --out exported/

Where things go during training: `export_hf: every_checkpoint` writes `checkpoints/step_N/hf/` next to each
Megatron checkpoint (pruned with it); `final` (the default) and `every_checkpoint` write `run_dir/hf/` from the
last checkpoint when the run ends. The conversion reads the checkpoint files (`trainer/weights/hf_export.py`), so it
runs in this process while the trainer keeps its memory, and it works the same on a checkpoint of any layout.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import yaml

from gspo_ray.coordinator.checkpoint import CheckpointManager

log = logging.getLogger(__name__)
HF_DIR = "hf"  # the HF directory's name next to a checkpoint, and in the run directory


@dataclass(frozen=True)
class CheckpointRef:
    """A trainer checkpoint located from a user's path, with the HF directory the run trained from."""

    trainer_dir: Path  # holds meta.json and the rank files
    step_dir: Path | None  # checkpoints/step_N (None for a bare trainer checkpoint)
    model_dir: Path


def _is_trainer_dir(p: Path) -> bool:
    return (p / "meta.json").is_file()


def run_model_dir(run_dir: Path) -> Path:
    """The HF directory a run trained from, read from its `config.yaml` (a tiny model lives in run_dir/model)."""
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{run_dir}: no config.yaml, cannot tell which model the run trained; pass --model-dir")
    raw = yaml.safe_load(cfg_path.read_text()) or {}
    model = raw.get("model") or {}
    if model.get("path"):
        path = Path(model["path"])
    elif model.get("packaged"):  # imported once into the model cache (models/cache.py); older runs: out_dir/models
        from gspo_ray.models.cache import packaged_model_dir

        path = packaged_model_dir(model["packaged"], model.get("cache_dir"))
        old = Path((raw.get("logging") or {}).get("out_dir", "runs")) / "models" / model["packaged"]
        path = old if not (path / "config.json").is_file() and (old / "config.json").is_file() else path
    else:
        path = run_dir / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{run_dir}/config.yaml: model directory {path} (model.path) has no config.json; "
                                "pass --model-dir")
    return path


def resolve_checkpoint(path: str | Path, model_dir: str | Path | None = None) -> CheckpointRef:
    """A run directory (its latest complete checkpoint), a `checkpoints/step_N` directory, or a trainer checkpoint
    directory -> CheckpointRef. `model_dir` overrides the model the run's config.yaml names."""
    p = Path(path)
    if _is_trainer_dir(p):
        trainer_dir, step_dir = p, p.parent if (p.parent / "loop.json").is_file() else None
    elif _is_trainer_dir(p / "trainer"):
        trainer_dir, step_dir = p / "trainer", p
    elif (p / "checkpoints").is_dir():
        latest = CheckpointManager(p).latest()
        if latest is None:
            raise FileNotFoundError(f"{p}: the run has no complete checkpoint yet")
        trainer_dir, step_dir = latest / "trainer", latest
    else:
        raise FileNotFoundError(f"{p}: not a run directory (checkpoints/), a checkpoint (trainer/meta.json) or a "
                                "trainer checkpoint (meta.json)")
    if model_dir is None:
        if step_dir is None or step_dir.parent.name != "checkpoints":
            raise FileNotFoundError(f"{p}: not inside a run directory; pass --model-dir (the HF model it trained)")
        model_dir = run_model_dir(step_dir.parent.parent)
    return CheckpointRef(trainer_dir=trainer_dir, step_dir=step_dir, model_dir=Path(model_dir))


def export_hf(path: str | Path, out: str | Path, dtype: str | None = None,
              model_dir: str | Path | None = None, merge: bool = False) -> Path:
    """`gspo-ray export`: the HF directory of a run's latest checkpoint or of one checkpoint, written to `out`.
    A LoRA run's checkpoint gives a PEFT adapter directory (over the run's base model), or with `merge` the
    merged HF model; `merge` changes nothing for a full fine-tuning checkpoint."""
    from gspo_ray.trainer.weights.hf_export import export_checkpoint
    from gspo_ray.trainer.lora.export import checkpoint_lora, export_adapter_dir
    from gspo_ray.trainer.model_spec import DTYPES

    ref = resolve_checkpoint(path, model_dir)
    if checkpoint_lora(ref.trainer_dir) is not None and not merge:
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"export dtype {dtype!r} unknown; valid: {', '.join(DTYPES)}")
        return export_adapter_dir(ref.trainer_dir, ref.model_dir, out, dtype=DTYPES[dtype or "float32"])
    return export_checkpoint(ref.trainer_dir, ref.model_dir, out, dtype=dtype)


def export_after_save(logging_cfg, step_dir: Path, model_dir: Path) -> Path | None:
    """`export_hf: every_checkpoint`: the checkpoint's HF directory, `step_dir/hf`."""
    if logging_cfg.export_hf != "every_checkpoint":
        return None
    from gspo_ray.trainer.weights.hf_export import export_checkpoint

    return export_checkpoint(step_dir / "trainer", model_dir, step_dir / HF_DIR, dtype=logging_cfg.export_dtype)


def export_final(logging_cfg, run_dir: Path, step_dir: Path | None, model_dir: Path) -> Path | None:
    """At the end of a run (`final` or `every_checkpoint`): the last checkpoint's HF directory as `run_dir/hf`."""
    if logging_cfg.export_hf == "none" or step_dir is None:
        return None
    from gspo_ray.trainer.weights.hf_export import export_checkpoint

    out = export_checkpoint(step_dir / "trainer", model_dir, run_dir / HF_DIR, dtype=logging_cfg.export_dtype)
    log.info("HF model of %s written to %s", step_dir.name, out)
    return out
