"""Where a rollout engine runs and the process state it needs: its executor (in-process or vLLM's multi-process
one), its CPU cores, its environment variables (set only while vLLM starts), vLLM's cache directory.

    mode = engine_mode(tensor_parallel_size)            # "in-process" | "multi-process"
    env = build_engine_env(run_dir, "0|1", on_cuda=False)
    with scoped_env(env): LLM(...)                      # restored afterwards
    hold_process({0}); ...; release_process()         # an in-process engine pins its process, then gives it back
"""
from __future__ import annotations

import os
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path


def default_cache_root() -> Path:
    """The machine-wide vLLM cache of gspo-ray engines: $VLLM_CACHE_ROOT when the user set one, else
    $XDG_CACHE_HOME/gspo-ray/vllm (~/.cache/gspo-ray/vllm): apart from vLLM's own ~/.cache/vllm."""
    if os.environ.get("VLLM_CACHE_ROOT"):
        return Path(os.environ["VLLM_CACHE_ROOT"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gspo-ray" / "vllm"


IN_PROCESS, MULTI_PROCESS = "in-process", "multi-process"


def engine_mode(tensor_parallel_size: int) -> str:
    """Where the engine's model runs: in-process for one device (measured on CPU: start-up 4 s against ~25-35 s
    for the multi-process executor), vLLM's multi-process executor for several."""
    return IN_PROCESS if tensor_parallel_size == 1 else MULTI_PROCESS


def worker_core_binding(cores: list[int], tensor_parallel_size: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for a multi-process CPU engine: the cores split into one contiguous block per
    TP worker, `|`-separated ([0, 1], 2 -> "0|1"; [0..3], 2 -> "0,1|2,3"). Fewer cores than workers: workers
    share them round-robin ([0], 2 -> "0|0"), slow but running."""
    cores = sorted(cores)
    per = max(1, len(cores) // tensor_parallel_size)
    blocks = [cores[(i * per) % len(cores):][:per] for i in range(tensor_parallel_size)]
    return "|".join(",".join(map(str, b)) for b in blocks)


# A Unix socket's path is at most 107 bytes (sockaddr_un.sun_path); vLLM's multi-process executor binds ZMQ sockets
# at f"{VLLM_RPC_BASE_PATH}/{uuid4()}" (36 characters) and refuses to start when that is longer.
SOCKET_PATH_MAX, RPC_NAME_LEN = 107, 36


def rpc_socket_dir(preferred: str | Path) -> str:
    """Where vLLM puts its ZMQ sockets: `preferred` (the run directory's tmp) when a socket path under it fits in
    a Unix socket address, else a short directory of this user's under the system temp dir (a run directory a
    few levels deep, e.g. pytest's or a cluster's home, is already too long for a TP > 1 engine)."""
    preferred = str(preferred)
    if len(os.fsencode(preferred)) + 1 + RPC_NAME_LEN <= SOCKET_PATH_MAX:
        return preferred
    return str(Path(tempfile.gettempdir()) / f"gspo-ray-rpc-{os.getuid()}")


def build_engine_env(run_dir: str | Path, cpu_cores: str | None, on_cuda: bool,
                     cache_root: str | Path | None = None) -> dict[str, str]:
    """Environment for an engine (its core in this process). CPU-only variables are left out when CUDA is present.

    cpu_cores: the engine's cores ("0", "1", "0-1"), or a multi-process engine's per-worker binding ("0|1");
        given to vLLM's own binding, which it applies to worker processes only.
    cache_root: vLLM's cache (default `default_cache_root()`). Worth sharing between engines and jobs: on a cold
        cache vLLM inspects each architecture in a subprocess that re-imports vLLM (measured 15-30 s of a job's
        start-up on 2 cores); its entries are keyed by a hash of the model code and written atomically.
    """
    run_dir = Path(run_dir)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process (see module docstring)
           "VLLM_CACHE_ROOT": str(cache_root or default_cache_root()),
           "TMPDIR": str(run_dir / "tmp"),  # temp files stay in the run directory
           "VLLM_RPC_BASE_PATH": rpc_socket_dir(run_dir / "tmp")}  # ... and ZMQ sockets when their path fits
    if not on_cuda:
        # Honoured by vLLM only when it spawns worker processes; in-process we bind ourselves (`bind_cores`).
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_cores or "auto"
    return env


@contextmanager
def scoped_env(env: dict[str, str]):
    """Set environment variables (and tempfile's directory) for the block, then restore the old values.

    The engine reads them while it starts; leaving them set would leak into the rest of the process (a later
    `ray.init` in the same process would put its sockets under this run's TMPDIR, for instance).
    """
    old = {key: os.environ.get(key) for key in env}
    old_tempdir = tempfile.tempdir
    os.environ.update(env)
    tempfile.tempdir = env.get("TMPDIR", old_tempdir)  # tempfile caches its directory on first use
    try:
        yield
    finally:
        tempfile.tempdir = old_tempdir
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def parse_cores(spec: str) -> set[int]:
    """"0" -> {0}; "0-2,5" -> {0, 1, 2, 5}."""
    cores: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def bind_cores(cores: set[int]) -> set[int]:
    """Pin every thread of this process (and threads it starts later) to `cores`; returns the old affinity.

    vLLM 0.32 binds OpenMP threads only for engines it runs in child processes, so an in-process engine must
    be bound here; otherwise two engines on one machine both spread over all cores and spin-wait on each other.
    """
    previous = os.sched_getaffinity(0)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread exited meanwhile
            pass
    return previous


_held = {"engines": 0, "affinity": None, "threads": None, "environ": None}  # see hold_process
_held_lock = threading.Lock()


def hold_process(cores: set[int] | None) -> None:
    """An in-process engine starts here: pin the process to `cores` (None: leave it) with one torch thread per core.

    The first holder saves the process's CPU affinity, torch thread count and os.environ (vLLM sets ~20 variables
    on import and start: LD_PRELOAD, LOCAL_WORLD_SIZE, ...); `release_process` by the last holder puts them back.
    Counted, because engines nest: a second engine's "before" is the first one's binding, so restoring per engine
    would leave the process pinned when the first one ends first."""
    import torch  # here, not at the top: the preflight imports this module and must not pay for torch

    with _held_lock:
        if _held["engines"] == 0:
            _held.update(affinity=os.sched_getaffinity(0), threads=torch.get_num_threads(), environ=dict(os.environ))
        _held["engines"] += 1
    if cores:
        bind_cores(cores)
        torch.set_num_threads(len(cores))


def release_process() -> None:
    """An engine ended (shut down, or failed to start): the last one gives the process back what the first saw."""
    with _held_lock:
        if _held["engines"] == 0:
            return
        _held["engines"] -= 1
        if _held["engines"]:
            return
        saved = dict(_held)
    import torch

    bind_cores(saved["affinity"])
    torch.set_num_threads(saved["threads"])
    for key in set(os.environ) - set(saved["environ"]):
        del os.environ[key]
    os.environ.update(saved["environ"])


def describe_engines(tensor_parallel_size: int, expert_parallel: bool, on_gpu: bool, transport: str = "shm") -> str:
    """One line for the job's start: where each rollout engine runs and how pushes reach it (`transport`: the
    resolved rollout.weight_transfer, rollout/weight_transfer.resolve_weight_transfer)."""
    from gspo_ray.rollout.weight_transfer import describe_transport

    device = "GPU" if on_gpu else "core"
    where = ("in-process (the model in the rollout actor's process)" if engine_mode(tensor_parallel_size) == IN_PROCESS
             else f"multi-process (vLLM's executor: {tensor_parallel_size} worker processes, one {device} each)")
    return (f"{where}, tensor_parallel_size {tensor_parallel_size}{', expert parallel' if expert_parallel else ''}; "
            f"full-weight pushes through vLLM's weight-transfer protocol: {describe_transport(transport)}")
