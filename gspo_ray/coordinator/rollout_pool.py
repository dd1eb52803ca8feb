"""The rollout pool: N RolloutWorker actors behind one submit/wait interface, with fault re-dispatch and scaling.

Prompts are split into per-worker chunks. If a worker dies mid-batch, its chunk goes back to the queue and is
served by a surviving (or freshly started) worker; every prompt comes back exactly once with `n` samples, which
`wait` asserts. New workers receive the current weights before they serve anything.

With `multi_turn=True` (the job sets `rollout.multi_turn`) chunks run as multi-turn episodes
(`RolloutWorker.run_episodes`: one Sample per episode, env tokens loss-masked) instead of single completions;
dispatch, re-dispatch and sampling overrides (`temperature=0.0` for greedy eval) are the same.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from gspo_ray.data.records import Group, Prompt, Sample

log = logging.getLogger(__name__)
WORKER_DEATH = (RayActorError, ActorDiedError, ActorUnavailableError)


@dataclass
class PendingRollout:
    """A dispatched rollout batch: object refs -> (worker id, chunk of prompts)."""

    prompts: list[Prompt]
    n: int
    sampling: dict[str, Any]
    inflight: dict[Any, tuple[int, list[Prompt]]] = field(default_factory=dict)
    t0: float = field(default_factory=time.perf_counter)


class RolloutPool:
    """`make_worker(worker_id) -> actor handle` builds one RolloutWorker actor (resources decided by the caller)."""

    def __init__(self, make_worker: Callable[[int], Any], num_workers: int, max_restarts: int = 3,
                 multi_turn: bool = False):
        self.make_worker = make_worker
        self.multi_turn = multi_turn  # chunks go to `run_episodes` (the workers' rollout.multi_turn env)
        self.workers: dict[int, Any] = {}
        self._next_id = 0
        self.restarts_left = max_restarts
        self.weights: tuple[int, Any, Any] | None = None  # (version, buckets ref, probe) of the live policy
        self.redispatched = 0
        for _ in range(num_workers):
            self._start_worker()
        ray.get([w.ping.remote() for w in self.workers.values()])

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    # -- generation -------------------------------------------------------------------------------------------
    def submit(self, prompts: list[Prompt], n: int, version: int | None = None, **sampling) -> PendingRollout:
        pending = PendingRollout(prompts=list(prompts), n=n, sampling=sampling)
        ids = sorted(self.workers)
        for i, wid in enumerate(ids):
            chunk = prompts[i::len(ids)]
            if chunk:
                self._send(pending, wid, chunk)
        return pending

    def wait(self, pending: PendingRollout) -> tuple[list[Group], dict[str, float]]:
        """Block until every prompt of the batch has its n samples; re-dispatch chunks of dead workers."""
        samples: list[Sample] = []
        while pending.inflight:
            ready, _ = ray.wait(list(pending.inflight), num_returns=1)
            ref = ready[0]
            wid, chunk = pending.inflight.pop(ref)
            try:
                samples += ray.get(ref)
            except WORKER_DEATH as e:
                log.warning("rollout worker %d died (%s); re-dispatching %d prompts", wid, type(e).__name__,
                            len(chunk))
                self.workers.pop(wid, None)
                self.redispatched += len(chunk)
                self._send(pending, self._surviving_worker(), chunk)
        groups = assemble_groups(pending.prompts, samples, pending.n)
        return groups, rollout_metrics(samples, time.perf_counter() - pending.t0, self.multi_turn)

    def generate(self, prompts: list[Prompt], n: int, **sampling) -> tuple[list[Group], dict[str, float]]:
        return self.wait(self.submit(prompts, n, **sampling))

    # -- weights ----------------------------------------------------------------------------------------------
    def push_weights(self, version: int, buckets, probe=None) -> dict[str, float]:
        """Push one exported policy into every engine (one object-store copy shared by all workers)."""
        t0 = time.perf_counter()
        ref = buckets if isinstance(buckets, ray.ObjectRef) else ray.put(buckets)
        self.weights = (version, ref, probe)
        calls = {wid: w.update_weights.remote(version, ref, probe) for wid, w in self.workers.items()}
        results = []
        for wid, call in calls.items():
            try:
                results.append(ray.get(call))
            except WORKER_DEATH as e:  # a dead engine misses this push; it is replaced below or on next use
                log.warning("rollout worker %d died during a weight push (%s)", wid, type(e).__name__)
                self.workers.pop(wid, None)
        if not self.workers:
            self._surviving_worker()  # starts a replacement, which receives these weights first
        out = {"sync/push_s": time.perf_counter() - t0}
        for key in ("sync/push_mb", "sync/verify_max_abs_diff", "sync/verify_s"):
            vals = [r[key] for r in results if key in r]
            if vals:
                out[key] = max(vals)
        return out

    # -- membership -------------------------------------------------------------------------------------------
    def scale(self, num_workers: int) -> dict[str, float]:
        """Add or remove workers between steps; new ones get the live weights before serving."""
        if num_workers < 1:
            raise ValueError(f"rollout pool needs at least one worker, asked for {num_workers}")
        while self.num_workers < num_workers:
            self._start_worker()
        while self.num_workers > num_workers:
            self._stop_worker(max(self.workers))
        return {"rollout/workers": self.num_workers}

    def shutdown(self) -> None:
        for wid in list(self.workers):
            self._stop_worker(wid)

    def _stop_worker(self, wid: int) -> None:
        """Let the engine shut down its own processes, then end the actor."""
        handle = self.workers.pop(wid)
        try:
            ray.get(handle.shutdown.remote(), timeout=30)
        except Exception:  # a dead worker has nothing left to shut down
            pass
        ray.kill(handle)

    def _start_worker(self) -> int:
        wid = self._next_id
        self._next_id += 1
        handle = self.make_worker(wid)
        if self.weights is not None:
            version, ref, probe = self.weights
            ray.get(handle.update_weights.remote(version, ref, probe))
        self.workers[wid] = handle
        return wid

    def _surviving_worker(self) -> int:
        if not self.workers:
            if self.restarts_left <= 0:
                raise RuntimeError("every rollout worker died and the restart budget is spent")
            self.restarts_left -= 1
            self._start_worker()
        return min(self.workers)

    def _send(self, pending: PendingRollout, wid: int, chunk: list[Prompt]) -> None:
        worker = self.workers[wid]
        call = worker.run_episodes if self.multi_turn else worker.generate
        ref = call.remote(chunk, pending.n, **pending.sampling)  # version: the worker's own
        pending.inflight[ref] = (wid, chunk)


def rollout_metrics(samples: list[Sample], seconds: float, multi_turn: bool = False) -> dict[str, float]:
    """Additive quantities only, so several rounds of one step can be summed. Episodes count model tokens as
    `rollout/tokens` (what the engine generated) and the environment's separately."""
    tokens = sum(s.num_tokens for s in samples)
    out = {"rollout/gen_s": seconds, "rollout/samples": len(samples),
           "rollout/truncated": sum(s.finish_reason == "length" for s in samples)}
    if multi_turn:
        model_tokens = sum(sum(s.loss_mask) for s in samples)
        out.update({"rollout/tokens": model_tokens, "rollout/env_tokens": tokens - model_tokens,
                    "rollout/turns": sum(s.reward_info.get("turns", 0.0) for s in samples),
                    "rollout/env_errors": sum(s.finish_reason == "env_error" for s in samples)})
    else:
        out["rollout/tokens"] = tokens
    return out


def assemble_groups(prompts: list[Prompt], samples: list[Sample], n: int) -> list[Group]:
    """Samples -> one Group per prompt, in prompt order. Every prompt must have exactly n samples."""
    by_uid: dict[str, list[Sample]] = {p.uid: [] for p in prompts}
    for s in samples:
        if s.prompt_uid not in by_uid:
            raise RuntimeError(f"rollout returned a sample for unknown prompt {s.prompt_uid!r}")
        by_uid[s.prompt_uid].append(s)
    bad = {uid: len(v) for uid, v in by_uid.items() if len(v) != n}
    if bad:
        raise RuntimeError(f"rollout lost or duplicated samples (expected {n} each): {bad}")
    return [Group(prompt=p, samples=sorted(by_uid[p.uid], key=lambda s: s.sample_index)) for p in prompts]
