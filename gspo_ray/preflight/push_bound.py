"""rollout.push_timeout_s against the scale model's estimate of one nccl / ipc push (rollout/weight_transfer.
estimate_push_s), before Ray: a bound a normal push cannot meet would abort every push of the job.

    check_push_timeout(cfg, facts.path)        # PreflightError naming the field, or None (shm / object_store jobs)

The model's HF bytes are its safetensors tensors' elements (headers only, no weights read) at the trainer's dtype,
what every engine worker takes in per push. A job whose model directory does not exist yet (model.tiny,
model.packaged) is checked again at its first push (coordinator/transfer_push.py measures it).
"""
from __future__ import annotations

from math import prod
from pathlib import Path

from gspo_ray.preflight.model import PreflightError, read_safetensors_header
from gspo_ray.rollout.weight_transfer import CUDA_TRANSPORTS, estimate_push_s, job_weight_transfer

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def model_push_bytes(model_dir: Path, dtype: str) -> int:
    """HF bytes of one push of the model in `model_dir` at the trainer's `dtype` (the safetensors headers'
    element counts)."""
    elements = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        elements += sum(prod(v["shape"]) for k, v in read_safetensors_header(file).items() if k != "__metadata__")
    return elements * DTYPE_BYTES[dtype]


def check_push_timeout(cfg, model_dir: Path | None) -> float | None:
    """The estimate of one push (seconds) where the job pushes through nccl / ipc and its model directory
    exists; PreflightError (one line naming rollout.push_timeout_s) if the bound is below it."""
    transport = job_weight_transfer(cfg)
    if transport not in CUDA_TRANSPORTS or model_dir is None:
        return None
    estimate = estimate_push_s(model_push_bytes(model_dir, cfg.trainer.dtype), transport)
    bound = cfg.rollout.push_timeout_s
    if bound < estimate:
        raise PreflightError(f"rollout.push_timeout_s ({bound:g} s) is below the estimate of one {transport} push "
                             f"of this model ({estimate:.0f} s, docs/rollout-engines.md): every push would be "
                             f"aborted; valid: >= {estimate:.0f}")
    return estimate
