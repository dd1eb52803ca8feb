"""Colocated engines sleep while the trainer ranks on their GPUs train (vLLM's sleep mode, in verl's order).

    sleep = EngineSleep(rollout_pool)          # colocated jobs (coordinator/loop.py); EngineSleep(None): no-ops
    sleep.sleep()                              # before the train phase: sleep(level=1, mode="wait") on each engine
    sleep.wake(["weights"])                    # before the push, which loads into them
    sleep.wake(["kv_cache"])                   # after it: the trainer's push buffers are freed by then

Each call goes to every engine at once and waits up to the pool's call_timeout_s; an engine that died is dropped
and one that does not answer is killed as wedged (`RolloutPool.drop_workers`, as before a push), so the step goes
on with the others. An engine without sleep mode (on CPU, where vLLM has none) answers False and keeps its memory.
"""
from __future__ import annotations

import time

WAKE_TAGS = ("weights", "kv_cache")  # vLLM's tags of LLM.wake_up, in the order a step restores them


class EngineSleep:
    """The coordinator's sleep and wake calls to a rollout pool's engines; `rollout` None: every call a no-op."""

    def __init__(self, rollout) -> None:
        self.rollout = rollout

    def sleep(self) -> dict[str, float]:
        """Every engine frees its GPU memory (weights to CPU, KV cache dropped) once its requests finished."""
        return self._call("sleep", "sync/sleep_s")

    def wake(self, tags: list[str]) -> dict[str, float]:
        """Every engine restores the memory of `tags` (of WAKE_TAGS)."""
        unknown = [t for t in tags if t not in WAKE_TAGS]
        if unknown:
            raise ValueError(f"unknown wake_up tags {unknown}; vLLM's are {', '.join(WAKE_TAGS)}")
        return self._call("wake_up", f"sync/wake_{'_'.join(tags)}_s", list(tags))

    def _call(self, method: str, metric: str, *args) -> dict[str, float]:
        if self.rollout is None or not self.rollout.workers:
            return {}
        import ray
        from ray.exceptions import GetTimeoutError

        from gspo_ray.coordinator.rollout_pool import WORKER_DEATH

        t0 = time.perf_counter()
        refs = {wid: getattr(h, method).remote(*args) for wid, h in self.rollout.workers.items()}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.rollout.call_timeout_s)
        dead, hung, slept = [], [], 0
        for wid, ref in refs.items():
            try:
                slept += bool(ray.get(ref, timeout=0))
            except GetTimeoutError:
                hung.append(wid)
            except WORKER_DEATH:
                dead.append(wid)
        if dead or hung:
            self.rollout.drop_workers(dead, hung)
        out = {metric: time.perf_counter() - t0}
        if method == "sleep":  # 0 where the engines have no sleep mode (CPU)
            out["sync/engines_asleep"] = float(slept)
        return out
