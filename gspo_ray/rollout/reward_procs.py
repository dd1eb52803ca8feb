"""Reward calls in killable child processes: a call past its timeout is killed with its process, which is replaced.

    pool = ProcessCallPool("gspo_ray.envs.rewards:copy_reward", num_procs=2)   # or a picklable callable
    outcomes = pool.run([(args, kwargs), ...], timeout_s=5.0)                  # one Outcome per call, in order
    pool.close()

Why processes: the rollout worker runs its vLLM engine in-process, so a reward in a thread shares the engine's
interpreter (GIL), and a runaway thread can never be stopped. Each child (`child_procs.spawn_child`: niced, dies
with its parent) loads the function once (by import path, or unpickled with cloudpickle). Calls stream to it (at
most PREFETCH queued per child) and results come back one by one; a call's clock starts when it reaches the head
of its child's queue. At most `num_procs` calls run at once: the cap on
the CPU that user code takes from the engine.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable

from gspo_ray.rollout.child_procs import child_env, end_children, enter_child, kill_child, spawn_child

PREFETCH = 4  # calls queued per child: the next ones are there when the current one returns
START_TIMEOUT_S = 120.0  # a child that has not loaded the function by then (a hanging import) breaks the pool


@dataclass
class Outcome:
    """What one call did: returned `value`, raised (`error_type`, `error`, `traceback`), or ran out of time."""

    value: Any = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None
    timed_out: bool = False


class _Child:
    """One child process, its two pipe ends, and the calls sent to it (the head one is running)."""

    def __init__(self, init: tuple[str, Any], env: dict[str, str]):
        self.popen, self.send, self.recv = spawn_child("gspo_ray.rollout.reward_procs:child_main", env)
        self.send.send(init)
        self.ready = False
        self.born = time.monotonic()
        self.queue: deque[int] = deque()
        self.head_since = 0.0

    def kill(self) -> None:
        kill_child(self.popen, self.send, self.recv)


class ProcessCallPool:
    """`num_procs` children calling one function; `run` is thread-safe (calls are served one batch at a time)."""

    def __init__(self, fn_or_path: str | Callable, num_procs: int = 2):
        if isinstance(fn_or_path, str):
            self._init: tuple[str, Any] = ("path", fn_or_path)
        else:
            import cloudpickle  # functions, lambdas and closures by value when not importable by name

            self._init = ("pickle", cloudpickle.dumps(fn_or_path))
        self._env = child_env()
        self._lock = threading.Lock()
        self.killed = 0  # children killed at a timeout (or found dead), all time
        self.broken: str | None = None  # the function cannot be loaded in a child: every call fails with this
        self._children = [_Child(self._init, self._env) for _ in range(num_procs)]

    @property
    def pids(self) -> list[int]:
        return [c.popen.pid for c in self._children]

    def run(self, calls: list[tuple[tuple, dict]], timeout_s: float) -> list[Outcome]:
        """Run every call (args, kwargs); each gets its own `timeout_s` of running time."""
        with self._lock:
            out: list[Outcome | None] = [None] * len(calls)
            todo = deque(range(len(calls)))
            while self.broken is None and (todo or any(c.queue for c in self._children)):
                self._assign(todo, calls, out)
                due = ([c.head_since + timeout_s for c in self._children if c.queue]
                       + [c.born + START_TIMEOUT_S for c in self._children if not c.ready])
                left = max(min(due) - time.monotonic(), 0.0) if due else None
                for conn in wait([c.recv for c in self._children if c.queue or not c.ready], left):
                    child = next(c for c in self._children if c.recv is conn)
                    while self._receive(child, out, todo) and child.queue and conn.poll():
                        pass  # drain what is already there: one wake-up for several results
                now = time.monotonic()
                if not any(c.ready for c in self._children) and all(now - c.born >= START_TIMEOUT_S
                                                                    for c in self._children):
                    self.broken = f"no reward process loaded the function within {START_TIMEOUT_S:g}s"
                for c in [c for c in self._children if c.queue and now - c.head_since >= timeout_s]:
                    out[c.queue.popleft()] = Outcome(timed_out=True)
                    self._replace(c, todo)
            return [o if o is not None else Outcome(error_type="RuntimeError", error=self.broken) for o in out]

    def _assign(self, todo: deque, calls: list, out: list) -> None:
        for c in self._children:
            while c.ready and todo and len(c.queue) < PREFETCH:
                i = todo.popleft()
                try:
                    c.send.send((i, *calls[i]))
                except (OSError, ValueError):  # the child is gone: its calls go elsewhere
                    todo.appendleft(i)
                    self._replace(c, todo)
                    break
                except Exception as e:  # the arguments do not pickle: only this call fails
                    out[i] = Outcome(error_type=type(e).__name__, error=f"arguments not picklable: {e}")
                    continue
                if len(c.queue) == 0:
                    c.head_since = time.monotonic()
                c.queue.append(i)

    def _receive(self, c: _Child, out: list, todo: deque) -> bool:
        """Take one message from a child; False when the child turned out dead (and was replaced)."""
        try:
            msg = c.recv.recv()
        except (EOFError, OSError):  # the child died (os._exit, a crash, an OOM kill): its head call fails
            code = c.popen.poll()
            if not c.ready:
                self.broken = f"reward process exited during start-up (exit code {code})"
            elif c.queue:
                out[c.queue.popleft()] = Outcome(error_type="ProcessExited",
                                                 error=f"the reward process died (exit code {code})")
            self._replace(c, todo)
            return False
        kind = msg[0]
        if kind == "ready":
            c.ready = True
        elif kind == "init_error":
            self.broken = msg[1]
        else:  # ("ok", i, value) | ("err", i, type name, message, traceback): always the head call
            i = c.queue.popleft()
            out[i] = Outcome(value=msg[2]) if kind == "ok" else Outcome(error_type=msg[2], error=msg[3],
                                                                        traceback=msg[4])
            c.head_since = time.monotonic()  # the next queued call starts now
        return True

    def _replace(self, c: _Child, todo: deque) -> None:
        """Kill a child (stuck or dead), put its queued calls back in front, start a fresh one."""
        todo.extendleft(reversed(c.queue))
        c.queue.clear()
        c.kill()
        self.killed += 1
        self._children[self._children.index(c)] = _Child(self._init, self._env)

    def close(self) -> None:
        """End every child: closing its input ends an idle one; a busy one is killed after a short grace."""
        end_children([(c.popen, c.send) for c in self._children])
        for c in self._children:
            c.recv.close()
        self._children = []


# ---- the child side -------------------------------------------------------------------------------------------
def _load(init: tuple[str, Any]) -> Callable:
    kind, payload = init
    if kind == "path":
        from gspo_ray.envs.plugins import resolve_callable

        return resolve_callable(payload, "reward.fn")
    import cloudpickle

    return cloudpickle.loads(payload)


def child_main(read_fd: int, write_fd: int, parent_pid: int) -> None:
    """Serve calls from the parent until its pipe closes."""
    import traceback

    recv, send = enter_child(read_fd, write_fd, parent_pid)
    try:
        fn = _load(recv.recv())
    except BaseException as e:  # reported once; the parent fails every call with it
        send.send(("init_error", f"reward function failed to load in its process: {type(e).__name__}: {e}"))
        return
    send.send(("ready",))
    while True:
        try:
            i, args, kwargs = recv.recv()
        except EOFError:
            return
        try:
            value = fn(*args, **kwargs)
        except BaseException as e:  # the user's function may raise anything; it fails only its call
            send.send(("err", i, type(e).__name__, str(e), traceback.format_exc()))
            continue
        try:
            send.send(("ok", i, value))
        except Exception as e:  # pickling happens before anything is written: the stream stays intact
            send.send(("err", i, "TypeError", f"returned an unpicklable {type(value).__name__}: {e}", ""))
