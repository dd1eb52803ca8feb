"""Where environment code runs: each episode's env object lives in a host, which runs its calls with a timeout.

    host = make_env_host(GuessNumberEnv, {"wrong_reward": -0.1}, tokenizer, isolation="process", num_procs=2)
    call = host.reset(episode_id, prompt, seed)          # runs now; an EnvCall
    if not call.wait(timeout_s): host.abandon(call, why)  # overran: stopped (process) or left behind (thread)
    call = host.step(episode_id, action_ids, text)        # the same env object
    host.release(episode_id); host.close()

isolation "process" (`EnvProcessPool`, the default): envs live in `num_procs` niced child processes of the rollout
worker (`child_procs`), and a call past its timeout is killed with its child. Why: the worker runs its vLLM engine
in-process, so an env call in a thread shares the engine's interpreter (GIL), and a runaway thread can never be
stopped. Envs are stateful, so an episode's env stays in the child that built it (the living one hosting fewest envs
when the episode reset; a dead one is replaced by a fresh one first). The cost of a bounded pool: killing a child
also loses the envs of the other episodes it hosts; they fail with "env process killed" (the one whose call overran
fails with the timeout). More processes, fewer casualties; `num_procs` also caps how many env calls run at once
(calls for one child run in order, and a call's clock starts when it reaches the head of its child's queue). The env
class must be importable or picklable (cloudpickle), and what it returns picklable.

isolation "thread" (`EnvThreadHost`): envs live in the worker's process and each call runs on its own daemon
thread; no start-up cost and any env works, but an overrunning call is only abandoned, never stopped.
"""
from __future__ import annotations

import itertools
import pickle
import threading
import time
from collections import deque
from typing import Any

from gspo_ray.envs.plugins import raise_site
from gspo_ray.rollout.child_procs import child_env, end_children, enter_child, kill_child, spawn_child

START_TIMEOUT_S = 120.0  # loading the env class and tokenizer in a fresh child; calls wait for it untimed


class EnvCall:
    """One env call in flight: `wait(timeout_s)` measures the timeout from the call's start (in a process host:
    when its child begins it; a child that has not loaded within START_TIMEOUT_S counts as overrun)."""

    def __init__(self, episode: int):
        self.episode = episode
        self.created = time.monotonic()
        self.value: Any = None
        self.error: BaseException | None = None
        self.started: float | None = None  # when the child began it (None: queued behind others)
        self._done = threading.Event()

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        if not self._done.is_set():
            self.value, self.error = value, error
            self._done.set()

    def wait(self, timeout_s: float) -> bool:
        """True when the call finished (returned, raised or was failed) within `timeout_s` of its start."""
        while not self._done.is_set():
            started = self.started
            if started is None:  # queued behind another call, or the child is still loading
                if time.monotonic() - self.created > START_TIMEOUT_S + timeout_s:
                    return False
                self._done.wait(0.05)
                continue
            left = started + timeout_s - time.monotonic()
            if left <= 0:
                return self._done.is_set()
            self._done.wait(left)
        return True


class EnvProcessError(RuntimeError):
    """The env's process is gone (killed at another call's timeout, or crashed): its state is lost."""


class _Child:
    """One child process hosting envs, its pipe, its queue of calls (the head one is running), a reader thread."""

    def __init__(self, pool: "EnvProcessPool"):
        self.pool = pool
        self.popen, self.send, self.recv = spawn_child("gspo_ray.rollout.env_hosts:child_main", pool._env)
        self.send.send(pool._init)
        self.queue: deque[EnvCall] = deque()
        self.episodes: set[int] = set()
        self.ready = False
        self.dead: str | None = None  # why it is gone
        threading.Thread(target=self._read, name="env-proc-reader", daemon=True).start()

    def submit(self, call: EnvCall, msg: tuple) -> None:
        """Queue `call` (caller holds the pool lock)."""
        if self.dead is not None:
            call._finish(error=EnvProcessError(self.dead))
            return
        try:
            self.send.send(msg)
        except (OSError, ValueError) as e:
            call._finish(error=EnvProcessError(f"env process unreachable: {e}"))
            return
        if not self.queue and self.ready:
            call.started = time.monotonic()
        self.queue.append(call)

    def _read(self) -> None:
        while True:
            try:
                msg = self.recv.recv()
            except (EOFError, OSError):
                with self.pool._lock:
                    self._fail_all(self.dead or f"env process died (exit code {self.popen.poll()})")
                self.recv.close()
                return
            with self.pool._lock:
                if msg[0] == "ready":
                    self.ready = True
                    if self.queue:
                        self.queue[0].started = time.monotonic()
                    continue
                if msg[0] == "init_error":  # every call to this child fails with it
                    self._fail_all(msg[1])
                    continue
                call = self.queue.popleft()
                if msg[0] == "ok":
                    call._finish(value=msg[1])
                else:
                    call._finish(error=_UserError(*msg[1:]))
                if self.queue:
                    self.queue[0].started = time.monotonic()

    def _fail_all(self, reason: str) -> None:
        self.dead = self.dead or reason
        while self.queue:
            self.queue.popleft()._finish(error=EnvProcessError(reason))

    @property
    def alive(self) -> bool:
        """Not known dead and its process still running (a process killed from outside may not have been noticed
        by the reader thread yet)."""
        return self.dead is None and self.popen.poll() is None

    def kill(self, reason: str) -> None:
        """Kill the process; every queued call and every hosted env fails with `reason` (caller holds the lock)."""
        self._fail_all(reason)
        kill_child(self.popen, self.send)  # the reader sees EOF, closes its end and ends


class _UserError(Exception):
    """An exception the env raised in its child, carried back by type name, message and raising frame."""

    def __init__(self, type_name: str, message: str, site: str | None = None):
        super().__init__(message)
        self.type_name, self.site = type_name, site


def _no_env(episode: int) -> EnvProcessError:
    return EnvProcessError(f"episode {episode} has no env (never reset, or released)")


def error_name(err: BaseException) -> str:
    """The name to report for an env error (the user's own exception type when it came from a child) and, when
    known, where it was raised (`ValueError at my_env.py:31`: failure reasons are grouped by both)."""
    name, site = (err.type_name, err.site) if isinstance(err, _UserError) else (type(err).__name__, raise_site(err))
    return f"{name} at {site}" if site else name


class EnvProcessPool:
    """`num_procs` children hosting env objects by episode id; thread-safe."""

    def __init__(self, env_cls: type, env_kwargs: dict[str, Any], tokenizer: Any, num_procs: int = 2):
        if num_procs < 1:
            raise ValueError(f"need num_procs >= 1, got {num_procs}")
        import cloudpickle  # classes defined in tests or notebooks travel by value when not importable

        self._init = (cloudpickle.dumps(env_cls), dict(env_kwargs), pickle.dumps(tokenizer))
        self._env = child_env()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.killed = 0  # children killed at a timeout, all time
        self._children = [_Child(self) for _ in range(num_procs)]
        self._home: dict[int, _Child] = {}

    def new_episode_id(self) -> int:
        return next(self._ids)

    @property
    def pids(self) -> list[int]:
        return [c.popen.pid for c in self._children]

    def reset(self, episode: int, prompt: Any, seed: int) -> EnvCall:
        """Build the episode's env (`cls(tokenizer=..., **kwargs)`) in the least-loaded living child and reset it."""
        call = EnvCall(episode)
        with self._lock:
            self._replace_dead()  # every child is alive now (or was a moment ago)
            child = min(self._children, key=lambda c: len(c.episodes))
            child.episodes.add(episode)
            self._home[episode] = child
            child.submit(call, ("reset", episode, prompt, seed))
        return call

    def alive(self, episode: int) -> bool:
        """Whether the episode's env still exists (its child was not killed and did not exit)."""
        with self._lock:
            child = self._home.get(episode)
            return child is not None and child.alive

    def step(self, episode: int, action_ids: list[int], text: str) -> EnvCall:
        call = EnvCall(episode)
        with self._lock:
            child = self._home.get(episode)
            if child is None:
                call._finish(error=_no_env(episode))
            else:
                child.submit(call, ("step", episode, list(action_ids), text))
        return call

    def abandon(self, call: EnvCall, reason: str) -> None:
        """Kill the child running `call` (it overran): the call and the other episodes it hosts fail."""
        with self._lock:
            child = self._home.get(call.episode)
            if child is not None and child.dead is None:
                child.kill(f"env process killed: {reason}")
                self.killed += 1

    def release(self, episode: int) -> None:
        """The episode ended: its env is dropped in its child (no reply)."""
        with self._lock:
            child = self._home.pop(episode, None)
            if child is not None:
                child.episodes.discard(episode)
                if child.dead is None:
                    try:
                        child.send.send(("close", episode))
                    except (OSError, ValueError):
                        pass

    def _replace_dead(self) -> None:
        """Start a fresh child in place of each dead one (caller holds the lock). Episodes it hosted keep pointing
        at the dead one, so their calls fail with EnvProcessError (their envs are lost) and no new episode lands
        there."""
        for i, c in enumerate(self._children):
            if not c.alive:
                c.dead = c.dead or f"env process exited (exit code {c.popen.poll()})"
                if c.popen.poll() is None:
                    kill_child(c.popen, c.send)
                self._children[i] = _Child(self)

    def close(self) -> None:
        """End every child: closing its input ends an idle one; a busy one is killed after a short grace."""
        with self._lock:
            children, self._children, self._home = self._children, [], {}
        end_children([(c.popen, c.send) for c in children])  # each reader then sees EOF and closes its end


class EnvThreadHost:
    """Envs in this process, each call on its own daemon thread (isolation "thread")."""

    def __init__(self, env_cls: type, env_kwargs: dict[str, Any], tokenizer: Any):
        self.env_cls, self.env_kwargs, self.tokenizer = env_cls, dict(env_kwargs), tokenizer
        self._ids = itertools.count()
        self._envs: dict[int, Any] = {}
        self.killed = 0

    def new_episode_id(self) -> int:
        return next(self._ids)

    def _run(self, episode: int, fn) -> EnvCall:
        call = EnvCall(episode)
        call.started = time.monotonic()

        def target() -> None:
            try:
                value = fn()
            except BaseException as e:  # the env may raise anything; it fails only its episode
                call._finish(error=e)
            else:
                call._finish(value=value)

        threading.Thread(target=target, daemon=True, name="env-call").start()
        return call

    def reset(self, episode: int, prompt: Any, seed: int) -> EnvCall:
        def build_and_reset():
            self._envs[episode] = env = self.env_cls(tokenizer=self.tokenizer, **self.env_kwargs)
            return env.reset(prompt, seed)

        return self._run(episode, build_and_reset)

    def alive(self, episode: int) -> bool:
        return episode in self._envs

    def step(self, episode: int, action_ids: list[int], text: str) -> EnvCall:
        env = self._envs.get(episode)
        if env is None:
            call = EnvCall(episode)
            call._finish(error=_no_env(episode))
            return call
        return self._run(episode, lambda: env.step(action_ids, text))

    def abandon(self, call: EnvCall, reason: str) -> None:
        """A thread cannot be stopped: the call is left running (daemon) and its episode ends."""

    def release(self, episode: int) -> None:
        self._envs.pop(episode, None)

    def close(self) -> None:
        self._envs.clear()


def make_env_host(env_cls: type, env_kwargs: dict[str, Any], tokenizer: Any, isolation: str = "process",
                  num_procs: int = 2) -> EnvProcessPool | EnvThreadHost:
    if isolation == "process":
        return EnvProcessPool(env_cls, env_kwargs, tokenizer, num_procs)
    if isolation == "thread":
        return EnvThreadHost(env_cls, env_kwargs, tokenizer)
    raise ValueError(f"unknown env isolation {isolation!r}; valid: process, thread")


# ---- the child side -------------------------------------------------------------------------------------------
def child_main(read_fd: int, write_fd: int, parent_pid: int) -> None:
    """Host env objects by episode id; serve reset / step / close until the parent's pipe closes."""
    recv, send = enter_child(read_fd, write_fd, parent_pid)
    try:
        import cloudpickle

        blob, kwargs, tok_blob = recv.recv()
        env_cls, tokenizer = cloudpickle.loads(blob), pickle.loads(tok_blob)
    except BaseException as e:  # reported once; the parent fails every call with it
        send.send(("init_error", f"env class failed to load in its process: {type(e).__name__}: {e}"))
        return
    send.send(("ready",))
    envs: dict[int, Any] = {}
    while True:
        try:
            msg = recv.recv()
        except EOFError:
            return
        op, episode = msg[0], msg[1]
        if op == "close":
            envs.pop(episode, None)
            continue
        try:
            if op == "reset":
                envs[episode] = env_cls(tokenizer=tokenizer, **kwargs)
                value = envs[episode].reset(msg[2], msg[3])
            else:
                value = envs[episode].step(msg[2], msg[3])
        except BaseException as e:  # the env may raise anything; it fails only its episode
            send.send(("err", type(e).__name__, str(e), raise_site(e)))
            continue
        try:
            send.send(("ok", value))
        except Exception as e:  # pickling happens before anything is written: the stream stays intact
            send.send(("err", "TypeError", f"returned an unpicklable {type(value).__name__}: {e}"))
