"""Child processes for user code (rewards, environments): started, niced, tied to their parent, killable.

    popen, send, recv = spawn_child("gspo_ray.rollout.env_procs:child_main", env)

Each child is a plain `python -c` started with two pipe fds (not multiprocessing's spawn, which re-runs the
parent's main module: a Ray worker's or a script's top level). The child lowers its priority (nice 10: when the
engine and user code want the same core, the engine wins) and exits as soon as its parent is gone.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

NICE = 10


def child_env() -> dict[str, str]:
    """The parent's environment with its module path: children import what the parent can (a user's module on
    a Ray worker's path)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def spawn_child(entry: str, env: dict[str, str]) -> tuple[subprocess.Popen, Connection, Connection]:
    """Start `python -c` running `entry` ("module:function", called as fn(read_fd, write_fd, parent_pid));
    returns the process and the parent's (send, recv) pipe ends."""
    module, fn = entry.split(":")
    code = f"import sys; from {module} import {fn}; {fn}(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))"
    to_child, from_child = os.pipe(), os.pipe()
    popen = subprocess.Popen([sys.executable, "-c", code, str(to_child[0]), str(from_child[1]), str(os.getpid())],
                             pass_fds=(to_child[0], from_child[1]), env=env, stdin=subprocess.DEVNULL)
    os.close(to_child[0])
    os.close(from_child[1])
    return popen, Connection(to_child[1], readable=False), Connection(from_child[0], writable=False)


def kill_child(popen: subprocess.Popen, *conns: Connection) -> None:
    """SIGKILL the child, reap it, close the parent's pipe ends."""
    popen.kill()
    popen.wait()
    for c in conns:
        c.close()


def end_children(children: list[tuple[subprocess.Popen, Connection]], grace_s: float = 1.0) -> None:
    """End (process, parent's send end) pairs: closing its input ends an idle child; one still busy after
    `grace_s` is killed."""
    for _, send in children:
        try:
            send.close()
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    for popen, _ in children:
        try:
            popen.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


def enter_child(read_fd: int, write_fd: int, parent_pid: int) -> tuple[Connection, Connection]:
    """The child side's first step: die with the parent, lower priority; returns (recv, send)."""
    _die_with_parent(parent_pid)
    os.nice(NICE)
    return Connection(read_fd, writable=False), Connection(write_fd, readable=False)


def _die_with_parent(parent_pid: int) -> None:
    """Exit as soon as the parent is gone, even in the middle of a runaway call: a watchdog thread polls the
    parent pid (PR_SET_PDEATHSIG would fire when the creating *thread* ends, which may be a short-lived one)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
