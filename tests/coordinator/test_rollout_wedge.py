"""A wedged rollout worker is killed and its prompts re-dispatched; an engine abort outside partial mode reaches
the buffer as failed samples; a CPU-bound runaway reward does not slow the engine it sits beside.

The package's Ray instance and one pool of two real vLLM workers for the whole module (worker 1 wedges on demand).
"""
import os
import sys
import time

import pytest
import ray

from gspo_ray.config import JobConfig, RolloutConfig
from gspo_ray.coordinator.buffer import GroupBuffer
from gspo_ray.coordinator.pools import rollout_actor_options
from gspo_ray.coordinator.rollout_pool import RolloutPool
from gspo_ray.data.prompts import PromptSource
from gspo_ray.models.tiny import make_tiny_model
from gspo_ray.rollout.worker import RolloutWorker

pytestmark = pytest.mark.slow
CALL_TIMEOUT_S = 8.0  # a warm tiny-model chunk takes well under 1 s even on a loaded machine
RUNAWAY = '''
import os


def runaway(completion, reference, *, pid_dir):
    """Spins on the CPU in pure Python forever (after recording its pid)."""
    with open(os.path.join(pid_dir, f"{os.getpid()}.pid"), "w"):
        pass
    while True:
        pass
'''


class WedgingRolloutWorker(RolloutWorker):
    """Serves normally until `wedge()`; then its generate never returns (a hung engine, a stuck driver call)."""

    def wedge(self):
        self._wedged = True

    def generate(self, prompts, n=None, **kwargs):
        if getattr(self, "_wedged", False):
            time.sleep(3600)
        return super().generate(prompts, n, **kwargs)

    def time_engine_beside_runaway(self, prompts, n, module_dir, isolation, timeout_s):
        """Median engine time of one batch (no scoring) before, and while a runaway reward of `isolation`
        spins in this worker; then the runaway's pid and whether it is still alive after its timeout."""
        from gspo_ray.data.records import Prompt, Sample
        from gspo_ray.rollout.scoring import RewardRunner

        sys.path.insert(0, module_dir)
        timed = lambda: min(self._timed_generate(prompts, n) for _ in range(3))  # noqa: E731
        before = timed()
        runner = RewardRunner("runaway_reward:runaway", self.model_path, timeout_s=timeout_s, num_procs=1,
                              isolation=isolation, fn_kwargs={"pid_dir": module_dir})
        sample = Sample(prompt_uid="r", sample_index=0, prompt_ids=[1], completion_ids=[1], logprobs=[0.0],
                        loss_mask=[1], versions=[0], finish_reason="stop")
        scored = runner.score_async([sample], {"r": Prompt(uid="r", prompt_ids=[1], reference="x")})
        while not any(f.endswith(".pid") for f in os.listdir(module_dir)):  # the runaway is spinning now
            time.sleep(0.05)
        during = timed()
        scored.result()
        pid = int(next(f for f in os.listdir(module_dir) if f.endswith(".pid")).split(".")[0])
        runner.close()
        return before, during, pid, os.path.exists(f"/proc/{pid}"), sample.failed

    def _timed_generate(self, prompts, n):
        start = time.perf_counter()
        with self._lock:
            self.engine.generate(prompts, n, self.sampling)
        return time.perf_counter() - start


@pytest.fixture(scope="module")
def pool(local_ray, tmp_path_factory):
    """On the package's shared Ray instance (conftest.local_ray; an instance of its own cost a Ray start here and
    another in the next module)."""
    root = tmp_path_factory.mktemp("wedge")
    model = make_tiny_model("qwen3_moe", root / "model", seed=0)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test class travels to the actors
    cfg = RolloutConfig(num_workers=2, group_size=4, max_new_tokens=6, max_model_len=64)
    actor = ray.remote(WedgingRolloutWorker).options(**rollout_actor_options(JobConfig(rollout=cfg)))
    p = RolloutPool(lambda wid: actor.remote(wid, str(model), cfg, str(root), reward_runner=cfg.reward), 2,
                    call_timeout_s=CALL_TIMEOUT_S)
    p.model = model
    yield p
    p.shutdown()


def test_engine_abort_outside_partial_reaches_the_buffer_as_failed(pool):
    worker = pool.workers[0]
    prompts = PromptSource.from_task("copy", str(pool.model), seed=5).take(3)
    ray.get(worker.pause.remote())  # a pause outside partial rollouts: every completion comes back "aborted"
    try:
        samples = ray.get(worker.generate.remote(prompts, 4))
    finally:
        ray.get(worker.resume.remote())
    assert all(s.finish_reason == "aborted" and s.reward is None and s.failed is None for s in samples)
    from gspo_ray.coordinator.rollout_pool import assemble_groups

    stats = GroupBuffer().admit(assemble_groups(prompts, samples, 4), current_version=0)  # was a TypeError
    assert (stats.admitted, stats.failed, stats.failed_samples) == (0, 3, 12)
    assert next(iter(stats.failure_reasons)).startswith("no reward: the engine stopped the completion")


def test_wedged_worker_is_killed_and_its_prompts_redispatched(pool):
    prompts = PromptSource.from_task("copy", str(pool.model), seed=3).take(12)
    pool.generate(prompts[:4], 4)  # both engines warm
    ray.get(pool.workers[1].wedge.remote())
    start = time.monotonic()
    groups, metrics = pool.generate(prompts, 4)
    elapsed = time.monotonic() - start
    # every prompt back exactly once with its group (assemble_groups raises on loss or duplication), all from
    # the survivor, after about one call timeout instead of never
    assert [g.uid for g in groups] == [p.uid for p in prompts] and metrics["rollout/samples"] == 48
    assert {s.worker_id for g in groups for s in g.samples} == {0}
    assert pool.wedged == 1 and pool.num_workers == 1 and pool.redispatched == 6
    assert CALL_TIMEOUT_S <= elapsed < CALL_TIMEOUT_S + 20, elapsed


def test_runaway_reward_does_not_slow_the_engine(pool, tmp_path):
    (tmp_path / "runaway_reward.py").write_text(RUNAWAY)
    prompts = PromptSource.from_task("copy", str(pool.model), seed=7).take(8)
    before, during, pid, alive, failed = ray.get(pool.workers[0].time_engine_beside_runaway.remote(
        prompts, 4, str(tmp_path), "process", 5.0))
    print(f"engine batch: {before:.3f} s before, {during:.3f} s beside a runaway reward process")
    # Generous bound for a shared 2-core machine: the niced runaway may take a core, never the interpreter.
    assert during < 2.5 * before + 0.5, (before, during)
    assert failed == "reward timed out after 5s"
    assert not alive  # killed at its timeout and reaped: nothing left spinning
