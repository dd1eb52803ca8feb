"""Async scale-down: a worker removed while a dispatched batch is in flight finishes its part of that batch (no
"aborted" completions, nothing counted failed), then stops; the batch comes back whole."""
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


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale_async")
    model = make_tiny_model("qwen3_moe", root / "model", seed=0)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield root, model
    ray.shutdown()


def test_scale_down_lets_the_batch_in_flight_finish(setup):
    root, model = setup
    # long enough completions that the batch is still generating when the scale-down arrives
    cfg = RolloutConfig(num_workers=2, group_size=8, max_new_tokens=40, max_model_len=64, temperature=1.0)
    actor = ray.remote(RolloutWorker).options(**rollout_actor_options(JobConfig(rollout=cfg)))
    pool = RolloutPool(lambda wid: actor.remote(wid, str(model), cfg, str(root), reward_runner=cfg.reward), 2)
    try:
        prompts = PromptSource.from_task("copy", str(model), seed=5).take(32)
        pending = pool.submit(prompts, cfg.group_size)     # the async batch in flight at a step boundary ...
        retired = pool.workers[1]
        assert pool.scale(1) == {"rollout/workers": 1}     # ... when `gspo-ray scale rollout 1` is applied
        assert pool.num_workers == 1 and list(pool.retiring) == [1]
        groups, metrics = pool.wait(pending)
        samples = [s for g in groups for s in g.samples]
        assert len(samples) == 32 * 8 and metrics["rollout/unfinished"] == 0
        assert {s.worker_id for s in samples} == {0, 1}    # worker 1 served its half to the end
        assert all(s.finish_reason in ("stop", "length") and s.reward is not None for s in samples)
        stats = GroupBuffer(filter_zero_adv=False).admit(groups, current_version=0)
        assert stats.failed_samples == 0 and stats.admitted == 32
        assert pool.retiring == {}                         # stopped once its calls were back
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(retired.ping.remote(), timeout=60)
        assert pool.scale(1) == {"rollout/workers": 1}     # a plain scale with nothing in flight still works
    finally:
        pool.shutdown()
