"""RewardRunner: score completions with a user reward function, in killable child processes, with a timeout.

    runner = RewardRunner("gspo_ray.envs.rewards:copy_reward", tokenizer, timeout_s=5.0, num_procs=2)
    metrics = runner.score(samples, {p.uid: p for p in prompts})   # fills reward / reward_info / failed
    future = runner.score_async(next_chunk, prompts)                # overlap scoring with generation

Each completion is decoded up to (not including) its first EOS token, special tokens kept, and the function gets
`eos_found` (protocol: `gspo_ray.envs.rewards`). The user's function never breaks a batch: when it raises, returns
something that is not a finite number, or runs past `timeout_s`, only that sample gets `failed` (the reason) and
`reward=None`; what its group then sees is the coordinator's failure policy (`rollout.reward.on_failure`).

isolation="process" (default, `reward_procs.ProcessCallPool`): calls run in `num_procs` niced child processes;
one that overruns is killed with its process, which is replaced, so a runaway reward neither keeps running nor
holds the engine's interpreter. isolation="thread": calls run in this process's threads (no start-up cost, for
functions that cannot be pickled). A thread cannot be killed: a call that overruns is abandoned (its sample fails
at once and a fresh thread takes its place); the stuck thread lives on until its call returns, counted in
`reward/abandoned_threads`.
"""
from __future__ import annotations

import logging
import math
import numbers
import queue
import threading
import time
import traceback
from concurrent.futures import ALL_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

from gspo_ray.data.prompts import load_tokenizer
from gspo_ray.data.records import Prompt, Sample
from gspo_ray.envs.plugins import traceback_site
from gspo_ray.envs.reward_calls import build_call_kwargs, resolve_reward
from gspo_ray.rollout.reward_procs import Outcome, ProcessCallPool

log = logging.getLogger(__name__)


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)
    started: float | None = None  # monotonic time the call began on a worker thread
    abandoned: bool = False  # timed out: the result, if it ever comes, is dropped


class _ThreadPool:
    """Daemon worker threads; a thread stuck in an overdue call is abandoned and replaced, keeping capacity."""

    def __init__(self, num_threads: int, name: str = "reward"):
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._name, self._count = name, 0
        self.num_threads, self.abandoned_alive = num_threads, 0
        for _ in range(num_threads):
            self._spawn()

    def _spawn(self) -> None:
        self._count += 1
        threading.Thread(target=self._work, name=f"{self._name}-{self._count}", daemon=True).start()

    def _work(self) -> None:
        while (call := self._queue.get()) is not None:
            with self._lock:
                call.started = time.monotonic()
            try:
                result, error = call.fn(), None
            except BaseException as e:  # the user's function may raise anything; it fails only its sample
                result, error = None, e
            with self._lock:
                if call.abandoned:
                    self.abandoned_alive -= 1
                    return  # a replacement thread already took this one's place
                if error is not None:
                    call.future.set_exception(error)
                else:
                    call.future.set_result(result)

    def submit(self, fn: Callable[[], Any]) -> _Call:
        call = _Call(fn)
        self._queue.put(call)
        return call

    def expire(self, call: _Call) -> bool:
        """Give up on a running call: resolve its future as abandoned and start a replacement thread."""
        with self._lock:
            if call.future.done() or call.started is None:
                return False
            call.abandoned = True
            self.abandoned_alive += 1
            call.future.set_exception(TimeoutError("abandoned"))
            self._spawn()
            return True

    def shutdown(self) -> None:
        for _ in range(self.num_threads):
            self._queue.put(None)


class _ThreadBackend:
    """isolation="thread": the calls in this process's threads; an overdue call is abandoned, not stopped."""

    def __init__(self, fn: Callable, num_threads: int):
        self.fn, self.pool = fn, _ThreadPool(num_threads)

    def run(self, calls: list[tuple[tuple, dict]], timeout_s: float) -> list[Outcome]:
        handles = [self.pool.submit(lambda a=a, k=k: self.fn(*a, **k)) for a, k in calls]
        self._wait(handles, timeout_s)
        out = []
        for h in handles:
            error = None if h.abandoned else h.future.exception()
            if h.abandoned:
                out.append(Outcome(timed_out=True))
            elif error is not None:
                out.append(Outcome(error_type=type(error).__name__, error=str(error),
                                   traceback="".join(traceback.format_exception(error))))
            else:
                out.append(Outcome(value=h.future.result()))
        return out

    def _wait(self, calls: list[_Call], timeout_s: float) -> None:
        """Block until every call finished or was abandoned at its deadline."""
        pending = [c for c in calls if not c.future.done()]
        while pending:
            now = time.monotonic()
            for c in pending:
                if c.started is not None and now - c.started >= timeout_s:
                    self.pool.expire(c)
            pending = [c for c in pending if not c.future.done()]
            # A call that starts after this point has its deadline >= now + timeout, so sleeping until the
            # earliest running deadline (at most one timeout) never misses one.
            deadlines = [c.started + timeout_s for c in pending if c.started is not None]
            sleep = min(deadlines, default=now + timeout_s) - now
            wait([c.future for c in pending], timeout=max(sleep, 0.001), return_when=ALL_COMPLETED)

    def metrics(self) -> dict[str, float]:
        return {"reward/abandoned_threads": float(self.pool.abandoned_alive)}

    def close(self) -> None:
        self.pool.shutdown()


class _ProcessBackend:
    """isolation="process": `ProcessCallPool`, whose overdue calls are killed with their process."""

    def __init__(self, fn_or_path: str | Callable, num_procs: int):
        self.pool = ProcessCallPool(fn_or_path, num_procs)
        self._killed_before = 0

    def run(self, calls: list[tuple[tuple, dict]], timeout_s: float) -> list[Outcome]:
        self._killed_before = self.pool.killed
        return self.pool.run(calls, timeout_s)

    def metrics(self) -> dict[str, float]:  # additive: processes replaced during the last run
        return {"reward/killed_procs": float(self.pool.killed - self._killed_before)}

    def close(self) -> None:
        self.pool.close()


def to_outcome(value: Any, num_tokens: int) -> tuple[float, dict[str, float], list[float] | None]:
    """(reward, reward_info, token_rewards) from a float or {"reward": float, ...}; ValueError when malformed."""
    info: dict[str, float] = {}
    token_rewards = None
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"reward returned a dict without 'reward' (keys: {', '.join(map(str, value))})")
        for key, component in value.items():
            if key == "reward":
                continue
            if key == "token_rewards":
                token_rewards = [float(x) for x in component]
                if len(token_rewards) != num_tokens:
                    raise ValueError(f"reward returned {len(token_rewards)} token_rewards for {num_tokens} tokens")
                continue
            if not isinstance(component, numbers.Real):  # bool and numpy scalars are Real too
                raise ValueError(f"reward component {key!r} is {type(component).__name__}, expected a number")
            info[str(key)] = float(component)
        value = value["reward"]
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        shown = repr(value) if isinstance(value, numbers.Real) else type(value).__name__
        raise ValueError(f"reward returned {shown}, expected a finite float or a dict with 'reward'")
    return float(value), info, token_rewards


def check_reward(fn_or_path: str | Callable | dict, fn_kwargs: dict[str, Any] | None = None) -> Callable:
    """Resolve and check a reward plug-in without starting anything (a pre-flight for the driver): returns the
    function (a `RoutedReward` for a mapping data_source -> function), or raises PluginError naming `reward.fn` /
    `reward.kwargs`."""
    if isinstance(fn_or_path, dict):  # each route checked against the kwargs it takes; the router passes them on
        return resolve_reward(fn_or_path, "reward", dict(fn_kwargs or {}))
    fn = resolve_reward(fn_or_path, "reward")
    build_call_kwargs(fn, dict(fn_kwargs or {}))
    return fn


class RewardRunner:
    """Scores `Sample`s in place with one reward function; owns its thread pool (`close()` or `with` ends it)."""

    def __init__(self, fn_or_path: str | Callable | dict, tokenizer_path_or_obj: Any, timeout_s: float = 5.0,
                 num_procs: int = 2, fn_kwargs: dict[str, Any] | None = None,
                 eos_token_ids: list[int] | None = None, isolation: str = "process"):
        if timeout_s <= 0 or num_procs < 1:
            raise ValueError(f"need reward.timeout_s > 0 and reward.num_procs >= 1, got {timeout_s}, {num_procs}")
        if isolation not in ("process", "thread"):
            raise ValueError(f"reward.isolation {isolation!r} unknown; valid: process, thread")
        self.fn = check_reward(fn_or_path, fn_kwargs)
        routed = isinstance(fn_or_path, dict)
        self.fn_name = (fn_or_path if isinstance(fn_or_path, str) else str(fn_or_path) if routed
                        else getattr(self.fn, "__qualname__", repr(self.fn)))
        self.fn_kwargs = {} if routed else dict(fn_kwargs or {})  # a RoutedReward holds its own
        self._call_kwargs = build_call_kwargs(self.fn, self.fn_kwargs)
        if routed:
            fn_or_path = self.fn  # pickles as its import paths
        self.tokenizer = load_tokenizer(tokenizer_path_or_obj)
        if eos_token_ids is None:
            if self.tokenizer.eos_token_id is None:
                raise ValueError("the tokenizer has no eos_token_id; pass eos_token_ids explicitly")
            eos_token_ids = [self.tokenizer.eos_token_id]
        self.eos_token_ids = frozenset(eos_token_ids)
        self.timeout_s = float(timeout_s)
        self._backend = (_ProcessBackend(fn_or_path, num_procs) if isolation == "process"
                         else _ThreadBackend(self.fn, num_procs))
        self._driver: ThreadPoolExecutor | None = None  # runs score() for score_async

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any, eos_token_ids: list[int] | None = None) -> RewardRunner:
        """From a `RewardConfig` (fn, kwargs, timeout_s, num_procs, isolation)."""
        return cls(cfg.fn, tokenizer, timeout_s=cfg.timeout_s, num_procs=cfg.num_procs,
                   fn_kwargs=dict(cfg.kwargs), eos_token_ids=eos_token_ids, isolation=cfg.isolation)

    def decode(self, completion_ids: list[int]) -> tuple[str, bool]:
        """(text up to the first EOS with special tokens kept, whether an EOS was found)."""
        cut = next((i for i, t in enumerate(completion_ids) if t in self.eos_token_ids), None)
        ids = completion_ids if cut is None else completion_ids[:cut]
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text, cut is not None

    def _call_args(self, sample: Sample, prompt: Prompt) -> tuple[tuple, dict]:
        """(args, kwargs) of the reward call for one sample: fn(text, reference, **declared context, **kwargs)."""
        text, eos_found = self.decode(sample.completion_ids)
        context = {"completion_ids": list(sample.completion_ids), "finish_reason": sample.finish_reason,
                   "eos_found": eos_found, "prompt_text": prompt.text, "meta": prompt.meta}
        return (text, prompt.reference), self._call_kwargs(context)

    def score(self, samples: list[Sample], prompts: dict[str, Prompt]) -> dict[str, float]:
        """Fill `reward`, `reward_info`, `token_rewards` of each sample, or `failed` + `reward=None`.

        Samples already marked failed are left alone. Never raises because of the reward function. Returns
        metrics (`reward/score_s`, `reward/num_failed`, `reward/num_timeouts`, and `reward/killed_procs` or
        `reward/abandoned_threads` by isolation).
        """
        start = time.monotonic()
        todo: list[tuple[Sample, tuple[tuple, dict]]] = []
        for s in samples:
            if s.failed is not None:
                continue
            prompt = prompts.get(s.prompt_uid)
            if prompt is None:
                s.reward, s.failed = None, f"no prompt with uid {s.prompt_uid!r} to score against"
                continue
            todo.append((s, self._call_args(s, prompt)))
        outcomes = self._backend.run([call for _, call in todo], self.timeout_s) if todo else []
        failed = 0
        for (s, _), outcome in zip(todo, outcomes):
            s.failed = self._apply(s, outcome)
            failed += s.failed is not None
            if s.failed is not None and failed == 1 and outcome.traceback:  # one traceback per batch is enough
                log.warning("reward function %s failed on %s/%d: %s\n%s", self.fn_name, s.prompt_uid,
                            s.sample_index, s.failed, outcome.traceback)
        return {"reward/score_s": time.monotonic() - start, "reward/num_failed": float(failed),
                "reward/num_timeouts": float(sum(o.timed_out for o in outcomes)), **self._backend.metrics()}

    def _apply(self, s: Sample, outcome: Outcome) -> str | None:
        """Write the call's outcome into the sample; returns the failure reason or None."""
        s.reward, s.reward_info, s.token_rewards = None, {}, None
        if outcome.timed_out:
            return f"reward timed out after {self.timeout_s:g}s"
        if outcome.error_type is not None:  # "at file.py:LINE": reasons are grouped by type and raising frame
            site = traceback_site(outcome.traceback)
            return f"reward raised {outcome.error_type}{f' at {site}' if site else ''}: {outcome.error}"
        try:
            s.reward, s.reward_info, s.token_rewards = to_outcome(outcome.value, len(s.completion_ids))
        except (TypeError, ValueError) as e:
            return str(e) if str(e).startswith("reward") else f"reward returned a bad value: {e}"
        return None

    def score_async(self, samples: list[Sample], prompts: dict[str, Prompt]) -> Future:
        """`score` on a background thread; the Future resolves to its metrics once every sample is filled in."""
        if self._driver is None:
            self._driver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-driver")
        return self._driver.submit(self.score, samples, prompts)

    def close(self) -> None:
        """Stop the reward processes (or threads; abandoned ones exit when their call returns)."""
        self._backend.close()
        if self._driver is not None:
            self._driver.shutdown(wait=True)
            self._driver = None

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
