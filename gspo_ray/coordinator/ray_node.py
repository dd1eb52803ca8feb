"""A Ray node as a child process this one owns: `ray start ... --block` in a session of its own.

    head = LocalRayHead(num_cpus=2, system_config={...}).start()   # head.address: "127.0.0.1:PORT"
    ray.init(address=head.address, ...)
    ...
    ray.shutdown(); head.stop()

Why a job starts its local Ray this way and not with a bare `ray.init()`: Ray 2.60 starts the GCS, raylet and
workers of a local instance in the driver's process group, with SIGINT blocked but not SIGTERM
(`ray/_private/services.py`, `start_ray_process`). A SIGTERM to the job's process group (`timeout`, a wrapper
script, a container's init, `kill -TERM -PGID`) then kills Ray under the driver while the driver tries to finish
its step and save: the job exits 1 with the steps since the last periodic checkpoint lost. Here the node's
`ray start --block` runs in a new session, so a signal to the driver's group reaches the driver alone; the
driver's own handling (coordinator/signals.py) finishes the step, saves and exits 143. The node is tied to the
driver: PR_SET_PDEATHSIG sends it SIGTERM when the driver dies, however it dies (SIGKILL included), and
`ray start --block` tears its node down in order on SIGTERM.

The port helpers and the node's stop are shared with cluster/local_cluster.py (a multi-node cluster on one
machine, for tests and local submission).
"""
from __future__ import annotations

import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

# Ports are drawn below the kernel's ephemeral range (32768-60999 on Linux), so an outgoing connection cannot
# take one between probing and `ray start` binding it, and above Ray's default worker range (10002-19999).
PORT_LO, PORT_HI = 20000, 32000
WORKER_PORTS_PER_NODE = 64
# AF_UNIX socket paths are limited to 107 bytes; Ray puts them at <temp>/session_<date>_<pid>/sockets/<name>.
MAX_TEMP_ROOT_LEN = 40
# Ports Ray would otherwise take at fixed defaults (client server 10001, dashboard agent 52365, ...): two nodes
# started at once on one machine (two jobs, a job beside a test cluster) would collide on them.
NODE_PORTS = ("node_manager", "object_manager", "dashboard_agent_listen", "dashboard_agent_grpc",
              "runtime_env_agent", "metrics_export")
HEAD_PORTS = ("gcs", "dashboard", "ray_client_server")


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def find_free_ports(n: int, taken: set[int], rng: random.Random) -> list[int]:
    """`n` distinct free TCP ports in [PORT_LO, PORT_HI) not in `taken` (which is updated)."""
    out: list[int] = []
    while len(out) < n:
        p = rng.randrange(PORT_LO, PORT_HI)
        if p not in taken and port_free(p):
            taken.add(p)
            out.append(p)
    return out


def find_free_port_block(size: int, taken: set[int], rng: random.Random, tries: int = 200) -> tuple[int, int]:
    """A contiguous free range [lo, hi] of `size` ports (Ray's --min/--max-worker-port)."""
    for _ in range(tries):
        lo = rng.randrange(PORT_LO, PORT_HI - size)
        block = range(lo, lo + size)
        if not taken.intersection(block) and all(port_free(p) for p in block):
            taken.update(block)
            return lo, lo + size - 1
    raise RuntimeError(f"no free block of {size} ports in [{PORT_LO}, {PORT_HI})")


def node_ports(head: bool, taken: set[int], rng: random.Random) -> dict[str, int]:
    """Every port a node listens on, free now: {name: port}, `ray start`'s `--NAME-port` (gcs is `--port`)."""
    names = list(NODE_PORTS) + (list(HEAD_PORTS) if head else [])
    ports = dict(zip(names, find_free_ports(len(names), taken, rng)))
    ports["min_worker"], ports["max_worker"] = find_free_port_block(WORKER_PORTS_PER_NODE, taken, rng)
    return ports


def port_args(ports: dict[str, int]) -> list[str]:
    """`ray start` flags for `node_ports`' ports."""
    return [f"--port={v}" if k == "gcs" else f"--{k.replace('_', '-')}-port={v}" for k, v in ports.items()]


def descendants(roots: list[int]) -> list[int]:
    """All live descendants of `roots` (walks /proc once)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4; the command name may contain spaces
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(roots)
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours still answers kill(0); treat it as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def own_session_tied_to_parent() -> None:
    """In the child before exec: a session of its own (a signal to the parent's process group does not reach
    it), and SIGTERM when the process that started it dies. Without the second, a parent killed with SIGKILL
    leaves the node running; `ray start --block` tears its node down in order on SIGTERM."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def ray_executable() -> str:
    """The `ray` script of this interpreter's environment (not whatever `ray` is first on PATH)."""
    exe = Path(sys.executable).parent / "ray"
    if not exe.exists():
        raise FileNotFoundError(f"no `ray` next to {sys.executable}; install ray[default] in this environment")
    return str(exe)


def node_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a node it starts: workers inherit it from the raylet, as they inherit the
    driver's from a `ray.init()` instance."""
    env = dict(os.environ)
    # Job entrypoints inherit the raylet's PATH: put this environment's bin first so `gspo-ray` resolves.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("RAY_ADDRESS", None)  # never join someone else's cluster
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # Ray 2.60 drains a node for up to 30 s on SIGTERM (for Serve upgrades); a node of ours stops at once.
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    env.update(extra or {})
    return env


def start_node_process(args: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    """`ray start *args --block`, its output in `log_path`, in its own session, tied to this process."""
    with open(log_path, "wb") as fh:
        return subprocess.Popen([ray_executable(), "start", *args, "--disable-usage-stats", "--block"],
                                stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                preexec_fn=own_session_tied_to_parent)


def stop_node_process(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM the node's `ray start --block` (it tears its node down in order), SIGKILL what remains."""
    # Ray starts job entrypoints in new sessions: collect the whole tree before it is orphaned.
    tree = set(descendants([proc.pid]))
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    deadline = time.monotonic() + 5.0
    while any(alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in tree:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def use_token_auth_as_ray_init_does() -> None:
    """Token auth for a new local instance, decided as `ray.init()` decides it (Ray 2.60, `worker.init`): on
    unless RAY_AUTH_MODE says otherwise, with ~/.ray/auth_token (made if missing) or the token the environment
    names. Set in this process's environment, so the node started next and this driver's `ray.init(address=...)`
    agree (a bare `ray start` would turn auth on only when a token file already exists)."""
    from ray._private.authentication.authentication_token_setup import (enable_token_auth_by_default,
                                                                        ensure_token_if_auth_enabled)

    enable_token_auth_by_default()
    ensure_token_if_auth_enabled({}, create_token_if_missing=True)


class LocalRayHead:
    """A one-node Ray instance for this process's job, outside its process group (module docstring).

    `start()` returns once the node has started (`address` is then set); `stop()` ends it and whatever it
    started. Use it with `ray.init(address=head.address)` and `ray.shutdown()` before `stop()`."""

    def __init__(self, num_cpus: int | None = None, system_config: dict | None = None,
                 start_timeout_s: float = 120.0):
        self.num_cpus = num_cpus
        self.system_config = dict(system_config or {})
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None
        self._dir: Path | None = None

    def start(self) -> "LocalRayHead":
        import json

        use_token_auth_as_ray_init_does()
        # short: Ray's unix sockets live under it (MAX_TEMP_ROOT_LEN); removed by stop()
        self._dir = Path(tempfile.mkdtemp(prefix="gspo-ray-", dir="/tmp"))
        ports = node_ports(head=True, taken=set(), rng=random.Random())
        args = ["--head", "--include-dashboard=false", f"--temp-dir={self._dir}", *port_args(ports)]
        if self.num_cpus is not None:
            args.append(f"--num-cpus={self.num_cpus}")
        if self.system_config:
            args.append(f"--system-config={json.dumps(self.system_config)}")
        log_path = self._dir / "ray_start.log"
        self.proc = start_node_process(args, log_path, node_env())
        try:
            self._wait_started(log_path)
        except BaseException:
            self.stop()
            raise
        self.address = f"127.0.0.1:{ports['gcs']}"
        return self

    def _wait_started(self, log_path: Path) -> None:
        """Until `ray start` says the runtime started (its GCS and raylet are up), or it exits, or the bound."""
        deadline = time.monotonic() + self.start_timeout_s
        while "Ray runtime started" not in log_path.read_text(errors="replace"):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the local Ray head exited with {self.proc.returncode} while starting; "
                                   f"its output:\n{tail(log_path)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the local Ray head did not start in {self.start_timeout_s:.0f} s; "
                                   f"its output:\n{tail(log_path)}")
            time.sleep(0.1)

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                stop_node_process(self.proc, timeout_s)
            self.proc = None
        if self._dir is not None:
            import shutil

            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
