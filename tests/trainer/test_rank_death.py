"""A trainer rank killed mid-run: the next pool call fails at once with TrainerRankDied and the surviving rank is
killed too, instead of waiting on the dead one in a collective for `collective_timeout_s`."""
from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from _spawn import algo_cfg, make_batch, trainer_cfg
from gspo_ray.trainer.pool import TrainerPool, TrainerRankDied


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def test_dead_rank_fails_the_call_at_once_and_kills_the_rest(local_ray, tiny_moe_dir):
    timeout_s = 120  # a survivor left waiting on the dead rank would block the call this long
    pool = TrainerPool(tiny_moe_dir, trainer_cfg(2, num_cpus_per_worker=1, collective_timeout_s=timeout_s),
                       algo_cfg())
    try:
        batch = make_batch(8)
        batch.old_logp = pool.compute_logprobs(batch)
        pool.train_step(batch)
        survivor = pool.workers[0]
        os.kill(ray.get(pool.workers[1].__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TrainerRankDied) as info:
            pool.train_step(batch)  # rank 0 enters the step's collectives; rank 1 is gone
        assert time.monotonic() - t0 < timeout_s / 4 and info.value.rank == 1
        with pytest.raises(ray.exceptions.RayActorError):  # the survivor was killed, not left in the collective
            ray.get(survivor.version.remote(), timeout=30)
        pool.restart()  # fresh ranks: the pool works again, from the initial weights
        assert pool.num_workers == 2 and pool.version() == 0
        pool.train_step(batch)
        assert pool.version() == 1
    finally:
        pool.shutdown()
