"""A multi-node Ray cluster on one machine, owned by this process: for tests and local job submission.

    python cluster/local_cluster.py --workers 1 --worker-resources '{"rollout_node": 1}'   # Ctrl-C stops it

    from cluster.local_cluster import LocalCluster
    with LocalCluster(num_worker_nodes=1, worker_resources={"rollout_node": 1}) as c:
        gspo_ray.cli.submission.submit("gspo_ray/recipes/tiny_moe.yaml", c.dashboard_url)

For fault tests: `add_worker(cpus, resources)` joins another node to the running cluster, `node_hosting(pid)` names
the node an actor's process runs on, `kill_node(name)` loses it (SIGKILL of its whole process tree), and
`node_death_s` shortens how long Ray takes to declare a silent node dead.

Each node is one `ray start ... --block` process started in its own session (process group), with its own
`--temp-dir` and its own set of free ports, so it never collides with another Ray on the same machine.
`stop()` signals exactly those process groups and any process that descended from them (the job entrypoints
Ray starts in their own sessions included). It never runs `ray stop`, which kills every Ray on the machine.

Ray 2.60: `--temp-dir` is honoured per node (a worker node given none falls back to the head's temp dir, read
from the GCS); the session name is the head's. Ports left unset fall back to fixed defaults (dashboard 8265,
client server 10001, dashboard agent 52365, workers 10002-19999) or to random ones; all are set here.
`--node-ip-address=127.0.0.1` is not honoured (Ray resolves loopback to the host's address), so nodes register
under the host IP while the dashboard binds 127.0.0.1. So the GCS and raylets listen on the host's address, and
the cluster uses Ray token auth with a token of its own: a random 256-bit token in `base_dir/auth_token` (mode 0600),
given to every node (`RAY_AUTH_MODE=token`, `RAY_AUTH_TOKEN_PATH`). While it runs, the owning process (and what it
starts: `gspo-ray submit`, job drivers) uses the same token: `start()` points `RAY_AUTH_TOKEN_PATH` at it and
`stop()` puts the old value back. Ray reads its auth mode once per process, so in an owner that used a Ray client
before `start()` only explicit headers work (`gspo_ray.cli.submission` sends them; so does `alive_nodes`).
"""
from __future__ import annotations

import json
import logging
import os
import random
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from gspo_ray.coordinator.ray_node import (MAX_TEMP_ROOT_LEN, alive, descendants, node_env, node_ports,
                                            port_args, start_node_process, stop_node_process, tail)

log = logging.getLogger(__name__)


@dataclass
class _Node:
    name: str
    proc: subprocess.Popen
    log: Path
    temp_dir: Path
    ports: dict[str, int] = field(default_factory=dict)


class LocalCluster:
    """A head (with dashboard) plus `num_worker_nodes` worker nodes, all local processes owned by this object.

    Attributes after `start()`: `address` (GCS, "127.0.0.1:PORT", for `ray.init(address=...)`),
    `dashboard_url` ("http://127.0.0.1:PORT", for job submission), `nodes` (name, PID, ports, log).
    """

    def __init__(self, num_worker_nodes: int = 1, head_cpus: int = 1, worker_cpus: int = 1,
                 head_resources: dict[str, float] | None = None, worker_resources: dict[str, float] | None = None,
                 base_dir: str | Path | None = None, object_store_mb: int = 256, start_timeout_s: float = 90.0,
                 seed: int | None = None, node_death_s: float | None = None):
        """node_death_s: declare a node dead after about this many seconds without health-check answers (Ray's
        default is ~15-25 s; a fault test that loses nodes waits that long per loss)."""
        self.num_worker_nodes = num_worker_nodes
        self.node_death_s = node_death_s
        self.head_cpus, self.worker_cpus = head_cpus, worker_cpus
        self.head_resources = dict(head_resources or {})
        self.worker_resources = dict(worker_resources or {})
        self.object_store_mb = object_store_mb
        self.start_timeout_s = start_timeout_s
        self._own_base = base_dir is None
        self.base_dir = Path(base_dir) if base_dir is not None else Path(tempfile.mkdtemp(prefix="gspo-rc-"))
        self._temp_root = self._pick_temp_root()
        self._rng = random.Random(seed)
        self._taken: set[int] = set()
        self.nodes: list[_Node] = []
        self.address: str | None = None
        self.dashboard_url: str | None = None
        self.token_path = self.base_dir / "auth_token"
        self._owner_env: dict[str, str | None] | None = None  # the owner's auth variables before start()

    def _pick_temp_root(self) -> Path:
        # pytest's tmp_path is often too long for Ray's unix sockets: fall back to a short dir of our own.
        if len(str(self.base_dir.resolve())) <= MAX_TEMP_ROOT_LEN:
            return self.base_dir
        self._own_temp_root = Path(tempfile.mkdtemp(prefix="gspo-rc-", dir="/tmp"))
        return self._own_temp_root

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, attempts: int = 3) -> "LocalCluster":
        """Start the head, wait for its dashboard, then each worker node, waiting until it is alive.

        On a saturated machine a node can die during startup (its raylet gives the dashboard agent ~15-20 s
        to come up): that node alone is stopped and started again on fresh ports, `attempts` times at most.
        """
        try:
            self._use_own_token()
            self._with_retries("head", self._start_head, attempts)
            for i in range(self.num_worker_nodes):
                self._with_retries(f"worker{i}", lambda i=i: self._start_worker(i), attempts)
        except BaseException:
            self.stop()
            raise
        return self

    # -- token auth --------------------------------------------------------------------------------------------
    def _use_own_token(self) -> None:
        """Write this cluster's token (0600) and make this process (and its children) present it."""
        from ray._raylet import AuthenticationTokenLoader, get_authentication_mode

        self.base_dir.mkdir(parents=True, exist_ok=True)
        self._token = secrets.token_hex(32)
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self._token)
        if self._owner_env is None:
            self._owner_env = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")}
        os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)})
        os.environ.pop("RAY_AUTH_TOKEN", None)  # would win over the path
        if get_authentication_mode() != 1:  # AuthenticationMode.TOKEN; Ray reads it once per process
            log.warning("this process read RAY_AUTH_MODE before the cluster started: its own Ray clients send no "
                        "token (gspo_ray's job-submission calls send it themselves; child processes are fine)")
        AuthenticationTokenLoader.instance().reset_cache()  # the loader caches the token it read first

    def _restore_owner_token(self) -> None:
        if self._owner_env is None:
            return
        for key, value in self._owner_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._owner_env = None
        from ray._raylet import AuthenticationTokenLoader

        AuthenticationTokenLoader.instance().reset_cache()

    def auth_header(self) -> dict[str, str]:
        """The HTTP header this cluster's dashboard requires."""
        return {"Authorization": f"Bearer {self._token}"}  # kept from start(): polled every 0.5 s while waiting

    def _with_retries(self, name: str, start_node, attempts: int) -> None:
        started_before = len(self.nodes)
        for attempt in range(1, attempts + 1):
            try:
                return start_node()
            except (RuntimeError, TimeoutError) as e:
                if attempt == attempts:
                    raise
                log.warning("ray node %s failed to start (attempt %d/%d), retrying: %s", name, attempt, attempts,
                            str(e).splitlines()[0])
                while len(self.nodes) > started_before:
                    self._stop_node(self.nodes.pop())

    def stop(self, timeout_s: float = 20.0) -> None:
        """Terminate the nodes this object started (workers first, then the head), then anything left behind."""
        # Workers go first: a worker node whose GCS is already gone waits ~20 s before giving up, and its agents
        # outlive it.
        while self.nodes:
            self._stop_node(self.nodes.pop(), timeout_s)
        self._restore_owner_token()
        if getattr(self, "_own_temp_root", None) is not None:
            shutil.rmtree(self._own_temp_root, ignore_errors=True)
        if self._own_base:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    @staticmethod
    def _stop_node(node: "_Node", timeout_s: float = 20.0) -> None:
        stop_node_process(node.proc, timeout_s)

    # -- nodes -------------------------------------------------------------------------------------------------
    def _node_ports(self, head: bool) -> dict[str, int]:
        return node_ports(head, self._taken, self._rng)

    def _ray_start(self, name: str, args: list[str], ports: dict[str, int], cpus: int,
                   resources: dict[str, float]) -> _Node:
        temp_dir = self._temp_root / name
        temp_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.base_dir / f"{name}.log"
        ports = {k: v for k, v in ports.items() if k != "gcs"}  # the head's GCS port is in `args`
        proc = start_node_process([*args, f"--temp-dir={temp_dir}", f"--num-cpus={cpus}", "--num-gpus=0",
                                   f"--resources={json.dumps(resources)}",
                                   f"--object-store-memory={self.object_store_mb << 20}", *port_args(ports)],
                                  log_path, _node_env(self.token_path, self.node_death_s))
        node = _Node(name, proc, log_path, temp_dir, ports)
        self.nodes.append(node)
        return node

    def _start_head(self) -> None:
        ports = self._node_ports(head=True)
        self._ray_start("head", ["--head", f"--port={ports['gcs']}", "--dashboard-host=127.0.0.1",
                                 "--include-dashboard=true"], ports, self.head_cpus, self.head_resources)
        self.address = f"127.0.0.1:{ports['gcs']}"
        self.dashboard_url = f"http://127.0.0.1:{ports['dashboard']}"
        self._wait(lambda: _http_ok(f"{self.dashboard_url}/api/version", self.auth_header()),
                   "the dashboard to answer")
        self._wait(lambda: len(self.alive_nodes()) >= 1, "the head node to register")

    def _start_worker(self, i: int, cpus: int | None = None, resources: dict[str, float] | None = None) -> None:
        ports = self._node_ports(head=False)
        self._ray_start(f"worker{i}", [f"--address={self.address}"], ports,
                        self.worker_cpus if cpus is None else cpus,
                        self.worker_resources if resources is None else resources)
        self._wait(lambda: len(self.alive_nodes()) >= len(self.nodes), f"worker{i} to register")

    def add_worker(self, cpus: int | None = None, resources: dict[str, float] | None = None,
                   attempts: int = 3) -> str:
        """Start one more worker node (its own CPUs and custom resources; default: the workers' own), wait until it
        is alive and return its name: a node added to a running cluster, as an autoscaler adds one."""
        i = 1 + max([int(n.name[6:]) for n in self.nodes if n.name.startswith("worker")], default=-1)
        self._with_retries(f"worker{i}", lambda: self._start_worker(i, cpus, resources), attempts)
        return f"worker{i}"

    def node_hosting(self, pid: int) -> str:
        """The name of the node whose process tree holds `pid` (e.g. an actor's worker process)."""
        for node in self.nodes:
            if node.proc.poll() is None and pid in descendants([node.proc.pid]):
                return node.name
        raise LookupError(f"pid {pid} is on none of this cluster's live nodes")

    def kill_node(self, name: str) -> None:
        """SIGKILL every process of a worker node at once: a machine lost, not a shutdown (its raylet gets no
        chance to say goodbye; the GCS finds out from its missed health checks). The node leaves `nodes`."""
        node = next(n for n in self.nodes if n.name == name)
        if node.name == "head":
            raise ValueError("kill_node is for worker nodes: the head holds the GCS")
        for pid in [node.proc.pid, *descendants([node.proc.pid])]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.proc.wait(timeout=10)
        self.nodes.remove(node)

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.proc.poll() is not None:
                    raise RuntimeError(f"ray node {node.name} exited with {node.proc.returncode} while waiting for "
                                       f"{what}; log {node.log}:\n{tail(node.log)}")
            if ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"timed out after {self.start_timeout_s} s waiting for {what}; logs in {self.base_dir}")

    def alive_nodes(self) -> list[dict]:
        """Alive nodes as the dashboard's state API reports them (node_id, resources_total, ...)."""
        try:
            req = urllib.request.Request(f"{self.dashboard_url}/api/v0/nodes?limit=1000", headers=self.auth_header())
            with urllib.request.urlopen(req, timeout=5) as r:
                body = json.loads(r.read())
        except (OSError, ValueError):
            return []
        return [n for n in body.get("data", {}).get("result", {}).get("result", []) if n.get("state") == "ALIVE"]

    def pids(self) -> list[int]:
        """PIDs of the node processes and everything below them (live)."""
        roots = [n.proc.pid for n in self.nodes if n.proc.poll() is None]
        return roots + descendants(roots)


def _node_env(token_path: Path, node_death_s: float | None = None) -> dict[str, str]:
    extra = {}
    if node_death_s is not None:  # read by the GCS (head) at start: 5 missed checks, one per node_death_s / 5
        period_ms = max(int(node_death_s * 1000 / 5), 200)
        extra.update({"RAY_health_check_period_ms": str(period_ms), "RAY_health_check_timeout_ms": str(period_ms),
                      "RAY_health_check_failure_threshold": "5"})
    # The nodes listen on the host's address: token auth, with this cluster's own token (not ~/.ray/auth_token,
    # which the first local ray.init() leaves readable by every user under the usual umask).
    extra.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)})
    env = node_env(extra)
    env.pop("RAY_AUTH_TOKEN", None)  # would win over the path
    return env


def _http_ok(url: str, headers: dict[str, str]) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description="Start a local multi-node Ray cluster; Ctrl-C stops it.")
    p.add_argument("--workers", type=int, default=1, help="worker nodes")
    p.add_argument("--head-cpus", type=int, default=1)
    p.add_argument("--worker-cpus", type=int, default=1)
    p.add_argument("--worker-resources", type=json.loads, default={}, help='JSON, e.g. {"rollout_node": 1}')
    p.add_argument("--base-dir", default=None, help="logs and temp dirs (default: a new dir under /tmp)")
    a = p.parse_args()
    with LocalCluster(a.workers, a.head_cpus, a.worker_cpus, worker_resources=a.worker_resources,
                      base_dir=a.base_dir) as c:
        print(f"RAY_ADDRESS={c.dashboard_url}  (gcs {c.address}); logs in {c.base_dir}\n"
              f"clients: export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={c.token_path}", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
