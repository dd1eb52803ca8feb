"""RewardRunner: score completions with a user reward function, in worker threads, with a per-call timeout.

    runner = RewardRunner("gspo_ray.envs.rewards:copy_reward", tokenizer, timeout_s=5.0, num_threads=2)
    metrics = runner.score(samples, {p.uid: p for p in prompts})   # fills reward / reward_info / failed
    future = runner.score_async(next_chunk, prompts)                # overlap scoring with generation

Each completion is decoded up to (not including) its first EOS token, special tokens kept, and the function gets
`eos_found` (protocol: `gspo_ray.envs.rewards`). The user's function never breaks a batch: when it raises, returns
something that is not a finite number, or runs past `timeout_s`, only that sample gets `failed` (the reason) and
`reward=None`; failed samples never train.

Limitation: a Python thread cannot be killed. A call that overruns is abandoned: its sample is marked failed at
once and a fresh thread takes its place, so the batch goes on; the stuck thread lives on (daemon, it never
blocks exit) and exits when its call finally returns. A function that hangs forever leaks one thread per
timed-out call (counted in `reward/abandoned_threads`): fix the function, or give it its own timeout inside.
"""
from __future__ import annotations

import inspect
import logging
import math
import numbers
import queue
import threading
import time
from concurrent.futures import ALL_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

from gspo_ray.data.prompts import load_tokenizer
from gspo_ray.data.records import Prompt, Sample
from gspo_ray.plugins import PluginError, resolve_callable

log = logging.getLogger(__name__)

# Passed by the runner on every call (protocol in gspo_ray.envs.rewards); reward.kwargs may not override them.
CONTEXT_KWARGS = ("completion_ids", "finish_reason", "eos_found", "prompt_text", "meta")


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


def build_call_kwargs(fn: Callable, fn_kwargs: dict[str, Any], field_name: str = "reward") -> Callable[[dict], dict]:
    """Check `fn` against the reward protocol once, up front; return a filter that keeps only the context keyword
    arguments `fn` declares (all of them when it takes **kwargs). Errors name `<field_name>.fn` / `.kwargs`."""
    clash = sorted(set(fn_kwargs) & set(CONTEXT_KWARGS))
    if clash:
        raise PluginError(f"{field_name}.kwargs may not set {clash}: the runner passes them on every call")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: pass what the protocol promises
        return lambda context: {**context, **fn_kwargs}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise PluginError(f"{field_name}.fn: {getattr(fn, '__name__', fn)!r} must take (completion, reference) "
                          f"positionally; its signature is {inspect.signature(fn)}")
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return lambda context: {**context, **fn_kwargs}
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(set(fn_kwargs) - names)
    if unknown:
        raise PluginError(f"{field_name}.kwargs: {getattr(fn, '__name__', fn)!r} takes no argument(s) {unknown}; "
                          f"its signature is {inspect.signature(fn)}")
    required = {p.name for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty}
    missing = sorted(required - set(fn_kwargs) - set(CONTEXT_KWARGS))
    if missing:
        raise PluginError(f"{field_name}.kwargs: {getattr(fn, '__name__', fn)!r} requires {missing}")
    wanted = [k for k in CONTEXT_KWARGS if k in names]
    return lambda context: {**{k: context[k] for k in wanted}, **fn_kwargs}


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


def check_reward(fn_or_path: str | Callable, fn_kwargs: dict[str, Any] | None = None) -> Callable:
    """Resolve and check a reward plug-in without starting anything (a pre-flight for the driver): returns the
    function, or raises PluginError naming `reward.fn` / `reward.kwargs`."""
    fn = resolve_callable(fn_or_path, "reward.fn")
    build_call_kwargs(fn, dict(fn_kwargs or {}))
    return fn


class RewardRunner:
    """Scores `Sample`s in place with one reward function; owns its thread pool (`close()` or `with` ends it)."""

    def __init__(self, fn_or_path: str | Callable, tokenizer_path_or_obj: Any, timeout_s: float = 5.0,
                 num_threads: int = 2, fn_kwargs: dict[str, Any] | None = None,
                 eos_token_ids: list[int] | None = None):
        if timeout_s <= 0 or num_threads < 1:
            raise ValueError(f"need reward.timeout_s > 0 and reward.num_threads >= 1, got {timeout_s}, {num_threads}")
        self.fn = check_reward(fn_or_path, fn_kwargs)
        self.fn_name = fn_or_path if isinstance(fn_or_path, str) else getattr(self.fn, "__qualname__", repr(self.fn))
        self.fn_kwargs = dict(fn_kwargs or {})
        self._call_kwargs = build_call_kwargs(self.fn, self.fn_kwargs)
        self.tokenizer = load_tokenizer(tokenizer_path_or_obj)
        if eos_token_ids is None:
            if self.tokenizer.eos_token_id is None:
                raise ValueError("the tokenizer has no eos_token_id; pass eos_token_ids explicitly")
            eos_token_ids = [self.tokenizer.eos_token_id]
        self.eos_token_ids = frozenset(eos_token_ids)
        self.timeout_s = float(timeout_s)
        self._pool = _ThreadPool(num_threads)
        self._driver: ThreadPoolExecutor | None = None  # runs score() for score_async

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any, eos_token_ids: list[int] | None = None) -> RewardRunner:
        """From a `RewardConfig` (fn, kwargs, timeout_s, num_threads)."""
        return cls(cfg.fn, tokenizer, timeout_s=cfg.timeout_s, num_threads=cfg.num_procs,
                   fn_kwargs=dict(cfg.kwargs), eos_token_ids=eos_token_ids)

    def decode(self, completion_ids: list[int]) -> tuple[str, bool]:
        """(text up to the first EOS with special tokens kept, whether an EOS was found)."""
        cut = next((i for i, t in enumerate(completion_ids) if t in self.eos_token_ids), None)
        ids = completion_ids if cut is None else completion_ids[:cut]
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text, cut is not None

    def _submit(self, sample: Sample, prompt: Prompt) -> _Call:
        text, eos_found = self.decode(sample.completion_ids)
        context = {"completion_ids": list(sample.completion_ids), "finish_reason": sample.finish_reason,
                   "eos_found": eos_found, "prompt_text": prompt.text, "meta": prompt.meta}
        kwargs = self._call_kwargs(context)
        return self._pool.submit(lambda: self.fn(text, prompt.reference, **kwargs))

    def _wait(self, calls: list[_Call]) -> int:
        """Block until every call finished or was abandoned at its deadline; returns the number abandoned."""
        abandoned = 0
        pending = [c for c in calls if not c.future.done()]
        while pending:
            now = time.monotonic()
            for c in pending:
                if c.started is not None and now - c.started >= self.timeout_s and self._pool.expire(c):
                    abandoned += 1
            pending = [c for c in pending if not c.future.done()]
            # A call that starts after this point has its deadline >= now + timeout, so sleeping until the
            # earliest running deadline (at most one timeout) never misses one.
            deadlines = [c.started + self.timeout_s for c in pending if c.started is not None]
            sleep = min(deadlines, default=now + self.timeout_s) - now
            wait([c.future for c in pending], timeout=max(sleep, 0.001), return_when=ALL_COMPLETED)
        return abandoned

    def score(self, samples: list[Sample], prompts: dict[str, Prompt]) -> dict[str, float]:
        """Fill `reward`, `reward_info`, `token_rewards` of each sample, or `failed` + `reward=None`.

        Samples already marked failed are left alone. Never raises because of the reward function. Returns
        metrics (`reward/score_s`, `reward/num_failed`, `reward/num_timeouts`, `reward/abandoned_threads`).
        """
        start = time.monotonic()
        todo: list[tuple[Sample, _Call]] = []
        for s in samples:
            if s.failed is not None:
                continue
            prompt = prompts.get(s.prompt_uid)
            if prompt is None:
                s.reward, s.failed = None, f"no prompt with uid {s.prompt_uid!r} to score against"
                continue
            todo.append((s, self._submit(s, prompt)))
        timeouts = self._wait([c for _, c in todo])
        failed = 0
        for s, call in todo:
            s.failed = self._apply(s, call)
            failed += s.failed is not None
            if s.failed is not None and failed == 1 and not call.abandoned:  # one traceback per batch is enough
                log.warning("reward function %s failed on %s/%d: %s", self.fn_name, s.prompt_uid, s.sample_index,
                            s.failed, exc_info=call.future.exception())
        return {"reward/score_s": time.monotonic() - start, "reward/num_failed": float(failed),
                "reward/num_timeouts": float(timeouts), "reward/abandoned_threads": float(self._pool.abandoned_alive)}

    def _apply(self, s: Sample, call: _Call) -> str | None:
        """Write the call's outcome into the sample; returns the failure reason or None."""
        s.reward, s.reward_info, s.token_rewards = None, {}, None
        if call.abandoned:
            return f"reward timed out after {self.timeout_s:g}s"
        error = call.future.exception()
        if error is not None:
            return f"reward raised {type(error).__name__}: {error}"
        try:
            s.reward, s.reward_info, s.token_rewards = to_outcome(call.future.result(), len(s.completion_ids))
        except (TypeError, ValueError) as e:
            return str(e) if str(e).startswith("reward") else f"reward returned a bad value: {e}"
        return None

    def score_async(self, samples: list[Sample], prompts: dict[str, Prompt]) -> Future:
        """`score` on a background thread; the Future resolves to its metrics once every sample is filled in."""
        if self._driver is None:
            self._driver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-driver")
        return self._driver.submit(self.score, samples, prompts)

    def close(self) -> None:
        """Stop the worker threads (abandoned ones exit when their call returns)."""
        self._pool.shutdown()
        if self._driver is not None:
            self._driver.shutdown(wait=True)
            self._driver = None

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
