"""Rollout faults: a worker that dies mid-batch loses nothing; its prompts are served by the survivor exactly once.

The engines capture routes (R3, rollout.capture_routes): a fresh prompt whose worker died is sampled again from its
start, so its routes are all of the new sample's own (every fed position, the last none); a partial completion
whose worker died mid-continuation keeps the routes of its finished segment (the coordinator still holds the
sample as it was dispatched) and gets the new segment's from the worker that continues it."""
import os
import sys

import numpy as np
import pytest
import ray

from gspo_ray.config import RolloutConfig
from gspo_ray.coordinator.pools import rollout_actor_options
from gspo_ray.coordinator.rollout_pool import RolloutPool
from gspo_ray.data.prompts import PromptSource
from gspo_ray.data.records import unpack_routes
from gspo_ray.models.tiny import make_tiny_model
from gspo_ray.rollout.worker import RolloutWorker

pytestmark = pytest.mark.slow


class DyingRolloutWorker(RolloutWorker):
    """Worker 1 generates half of its chunk, then its process dies (a node loss, an OOM kill)."""

    def generate(self, prompts, n=None, **kwargs):
        if self.worker_id == 1:
            super().generate(prompts[: len(prompts) // 2], n, **kwargs)
            os._exit(1)
        return super().generate(prompts, n, **kwargs)


@pytest.fixture(scope="module")
def setup(local_ray, tmp_path_factory):
    """On the package's shared Ray instance (conftest.local_ray; an instance of its own cost a Ray start here and
    another in the next module)."""
    root = tmp_path_factory.mktemp("faults")
    model = make_tiny_model("qwen3_moe", root / "model", seed=0)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test class travels to the actors
    return root, model


def test_dead_worker_prompts_are_redispatched_once(setup):
    root, model = setup
    cfg = RolloutConfig(num_workers=2, group_size=4, max_new_tokens=6, max_model_len=64, capture_routes=True)
    from gspo_ray.config import JobConfig

    opts = rollout_actor_options(JobConfig(rollout=cfg))
    actor = ray.remote(DyingRolloutWorker).options(**opts)
    pool = RolloutPool(lambda wid: actor.remote(wid, str(model), cfg, str(root), reward_runner=cfg.reward), 2)
    try:
        prompts = PromptSource.from_task("copy", str(model), seed=3).take(12)
        groups, metrics = pool.generate(prompts, cfg.group_size)
        # every prompt back exactly once, with its full group (assemble_groups raises on loss or duplication)
        assert [g.uid for g in groups] == [p.uid for p in prompts]
        assert all(len(g.samples) == 4 for g in groups)
        assert pool.num_workers == 1 and pool.redispatched == 6        # worker 1's chunk: prompts 1, 3, 5, ...
        assert {s.worker_id for g in groups for s in g.samples} == {0}
        assert all(s.reward is not None for g in groups for s in g.samples)
        assert metrics["rollout/samples"] == 48
        for s in (s for g in groups for s in g.samples):  # restarted cleanly: every fed position routed
            routes = unpack_routes(s.routes)
            assert routes.shape[0] == len(s.prompt_ids) + s.num_tokens
            assert (routes[:-1] >= 0).all() and (routes[-1] == -1).all()
    finally:
        pool.shutdown()


class DyingOnContinueWorker(RolloutWorker):
    """Worker 1 samples normally, but its process dies when asked to continue partial completions."""

    def continue_samples(self, samples, budget=None, version=None, prompts=None):
        if self.worker_id == 1:
            os._exit(1)
        return super().continue_samples(samples, budget=budget, version=version, prompts=prompts)


def test_dead_worker_partial_completions_are_continued_elsewhere(setup):
    root, model = setup
    cfg = RolloutConfig(num_workers=2, group_size=3, max_new_tokens=8, max_model_len=64, capture_routes=True)
    from gspo_ray.config import JobConfig

    actor = ray.remote(DyingOnContinueWorker).options(**rollout_actor_options(JobConfig(rollout=cfg)))
    pool = RolloutPool(lambda wid: actor.remote(wid, str(model), cfg, str(root / "c"), reward_runner=cfg.reward), 2)
    try:
        prompts = PromptSource.from_task("copy", str(model), seed=4).take(6)
        first, _ = pool.wait(pool.submit(prompts, cfg.group_size, budget=2))  # segment 1: at most 2 tokens each
        open_groups = [g for g in first if any(s.finish_reason == "aborted" for s in g.samples)]
        assert len(open_groups) >= 4 and {s.worker_id for g in first for s in g.samples} == {0, 1}
        carried = [(g.prompt, g.samples, None) for g in open_groups]    # last segment: run to the end
        done, metrics = pool.wait(pool.submit([], cfg.group_size, carried=carried))
        assert [g.uid for g in done] == [g.uid for g in open_groups] and pool.num_workers == 1
        assert pool.redispatched >= 1 and metrics["rollout/continued_groups"] == len(open_groups)
        for before, after in zip(open_groups, done):
            for s0, s1 in zip(before.samples, after.samples):
                assert s1.finish_reason in ("stop", "length") and s1.reward is not None
                # nothing lost or redone: the first segment's tokens, log-probs and versions are kept as they were
                assert s1.completion_ids[:s0.num_tokens] == s0.completion_ids
                assert s1.logprobs[:s0.num_tokens] == s0.logprobs and s1.versions[:s0.num_tokens] == s0.versions
                assert s1.segments == s0.segments + (s0.finish_reason == "aborted")
                # R3: the finished segment's routes kept as sampled, the new segment's positions routed too
                r0, r1 = unpack_routes(s0.routes), unpack_routes(s1.routes)
                fed = len(s0.prompt_ids) + s0.num_tokens - 1  # positions the first segment fed
                np.testing.assert_array_equal(r1[:fed], r0[:fed])
                assert (r1[:-1] >= 0).all() and (r1[-1] == -1).all()
    finally:
        pool.shutdown()
