"""Process-group setup for the trainer: torch.distributed + Megatron model-parallel groups.

    init_distributed(rank, world_size, master_addr, master_port, *, tp=1, ep=1, backend=None, timeout_s=600,
                     seed=0, init_method=None) -> None
    destroy_distributed() -> None
    free_port() -> int

Layout: world = TP x DP (pipeline and context parallelism are 1); experts use EP with expert-TP 1, carved out of
DP x TP by Megatron (`ep` must divide `world_size`). Backend: gloo on CPU, nccl on GPU (`backend` overrides).
On a machine without CUDA the megatron CPU workarounds are applied first (megatron_cpu_compat.apply()).
"""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
from gspo_ray.trainer.megatron_import import megatron_core  # noqa: F401  (first: megatron without torch.compile)


def free_port() -> int:
    """A TCP port that was free a moment ago on this host (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_layout(world_size: int, tp: int, ep: int) -> None:
    """Raise a clear error for a layout Megatron would reject later (or hang on)."""
    if tp < 1 or ep < 1 or world_size < 1:
        raise ValueError(f"tp={tp}, ep={ep}, world_size={world_size} must all be >= 1")
    if world_size % tp:
        raise ValueError(f"world_size={world_size} is not divisible by tp={tp}")
    if world_size % ep:
        raise ValueError(f"world_size={world_size} is not divisible by ep={ep} (expert-TP is 1)")


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, *, tp: int = 1, ep: int = 1,
                     backend: str | None = None, timeout_s: float = 600, seed: int = 0,
                     init_method: str | None = None) -> None:
    """Join the process group and build Megatron's TP/DP/EP groups; seed the model-parallel RNGs.

    All `world_size` processes must call it with the same arguments except `rank`. `timeout_s` bounds every
    collective so a bad layout or a dead peer fails instead of hanging (`trainer.collective_timeout_s`: keep it
    above the slowest checkpoint save or weight export, which other ranks wait for). `init_method` (e.g.
    "file:///tmp/run/rdzv", a file that does not exist yet) replaces the tcp://master_addr:master_port rendezvous:
    no port to race for on a busy host.
    """
    from megatron.core import parallel_state, tensor_parallel

    from gspo_ray.trainer import megatron_cpu_compat

    check_layout(world_size, tp, ep)
    megatron_cpu_compat.apply()
    backend = backend or default_backend()
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method or f"tcp://{master_addr}:{master_port}",
                                rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
            distributed_timeout_minutes=timeout_s / 60.0)
    # Dropout outside TP regions shares the data-parallel seed; TP/EP regions get per-rank seeds (Megatron's rule).
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    """Tear down Megatron groups and the default process group; safe to call twice or when never initialised."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
