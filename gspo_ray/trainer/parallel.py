"""Process-group setup for the trainer: torch.distributed + Megatron model-parallel groups.

    init_distributed(rank, world_size, master_addr, master_port, *, tp=1, ep=1, cp=1, pp=1, backend=None,
                     timeout_s=600, seed=0, init_method=None) -> None
    destroy_distributed() -> None
    free_port(exclude=()) -> int

Layout: world = PP x DP x CP x TP (Megatron's order; trainer.cp and trainer.pp, 1 unless set); experts use EP with
expert-TP 1, carved out of DP x CP x TP by Megatron (`ep` must divide `world_size`). Backend: gloo on CPU, nccl on GPU (`backend` overrides).
On a machine without CUDA the megatron CPU workarounds are applied first (megatron_cpu.apply()).
"""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
from gspo_ray.compat.megatron_import import megatron_core  # noqa: F401  (first: megatron without torch.compile)


# Ports for MASTER_PORT / TCPStore come from below the kernel's ephemeral range: a port the kernel handed out for
# bind(0) is handed out again to the next outgoing connection (gloo's full mesh, a store client, Ray), which then
# takes it between our pick and the store's listen (EADDRINUSE). Ray's worker ports default to 10002-19999.
_PORT_FLOOR = 20000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # the Linux default


def free_port(exclude: frozenset[int] | set[int] = frozenset()) -> int:
    """A TCP port, free a moment ago on this host and outside the ephemeral range, not in `exclude` (MASTER_PORT)."""
    import random

    hi = _ephemeral_low()
    rng = random.Random()  # own state: seeded global RNGs (tests, jobs) would hand every caller the same port
    for _ in range(200):
        port = rng.randrange(_PORT_FLOOR, hi) if hi > _PORT_FLOOR + 100 else 0
        if port in exclude:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            picked = s.getsockname()[1]
        if picked not in exclude:
            return picked
    raise RuntimeError(f"no free TCP port in [{_PORT_FLOOR}, {hi}) after 200 tries")


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_layout(world_size: int, tp: int, ep: int, cp: int = 1, pp: int = 1) -> None:
    """Raise a clear error for a layout Megatron would reject later (or hang on)."""
    if min(tp, ep, cp, pp, world_size) < 1:
        raise ValueError(f"tp={tp}, ep={ep}, cp={cp}, pp={pp}, world_size={world_size} must all be >= 1")
    if world_size % (tp * cp * pp):
        raise ValueError(f"world_size={world_size} is not divisible by tp x cp x pp = {tp} x {cp} x {pp}")
    if world_size % (ep * pp):  # each pipeline stage's ranks hold every expert once over EP
        raise ValueError(f"world_size={world_size} is not divisible by ep x pp = {ep} x {pp} (expert-TP is 1)")


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, *, tp: int = 1, ep: int = 1,
                     cp: int = 1, pp: int = 1, backend: str | None = None, timeout_s: float = 600, seed: int = 0,
                     init_method: str | None = None) -> None:
    """Join the process group and build Megatron's TP/DP/EP groups; seed the model-parallel RNGs.

    All `world_size` processes must call it with the same arguments except `rank`. `timeout_s` bounds every
    collective so a bad layout or a dead peer fails instead of hanging (`trainer.collective_timeout_s`: keep it
    above the slowest checkpoint save or weight export, which other ranks wait for). `init_method` (e.g.
    "file:///tmp/run/rdzv", a file that does not exist yet) replaces the tcp://master_addr:master_port rendezvous:
    no port to race for on a busy host.
    """
    from megatron.core import parallel_state, tensor_parallel

    from gspo_ray.compat import megatron_cpu

    check_layout(world_size, tp, ep, cp, pp)
    megatron_cpu.apply()
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
            context_parallel_size=cp, pipeline_model_parallel_size=pp,
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
