"""A trainer rank killed mid-run: the next pool call fails at once with TrainerRankDied and the surviving rank is
killed too, instead of waiting on the dead one in a collective for `collective_timeout_s`. An error inside one rank
(not a death) does the same, and the call raises that rank's error (TrainerRankFailed), a full disk still seen as
one."""
from __future__ import annotations

import errno
import os
import signal
import time

import pytest
import ray

from _spawn import algo_cfg, make_batch, trainer_cfg
from gspo_ray.trainer.pool import TrainerPool, TrainerRankDied, TrainerRankFailed


TIMEOUT_S = 120  # a rank left waiting on a dead or failed one in a collective would block the call this long


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(local_ray, tiny_moe_dir):
    """One pool for the module (a start costs ~15 s here): each test leaves it restarted or checks it is alive."""
    pool = TrainerPool(tiny_moe_dir, trainer_cfg(2, num_cpus_per_worker=1, collective_timeout_s=TIMEOUT_S),
                       algo_cfg())
    yield pool
    pool.shutdown()


def test_dead_rank_fails_the_call_at_once_and_kills_the_rest(pool):
    batch = make_batch(8)
    batch.old_logp = pool.compute_logprobs(batch)
    pool.train_step(batch)
    survivor = pool.workers[0]
    os.kill(ray.get(pool.workers[1].__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TrainerRankDied) as info:
        pool.train_step(batch)  # rank 0 enters the step's collectives; rank 1 is gone
    assert time.monotonic() - t0 < TIMEOUT_S / 4 and info.value.rank == 1
    with pytest.raises(ray.exceptions.RayActorError):  # the survivor was killed, not left in the collective
        ray.get(survivor.version.remote(), timeout=30)
    pool.restart()  # fresh ranks: the pool works again, from the initial weights
    assert pool.num_workers == 2 and pool.version() == 0
    pool.train_step(batch)
    assert pool.version() == 1


def test_an_error_in_one_rank_fails_the_call_at_once_with_that_error(pool):
    if pool.dead_ranks():  # the test before failed midway
        pool.restart()
    batch = make_batch(8)
    with pytest.raises(TrainerRankFailed, match="ValueError: .*needs algorithm.beta > 0") as info:
        pool.compute_logprobs(batch, reference=True)  # no reference model: every rank refuses alike
    assert not info.value.killed  # all of them idle and in step: the pool stays
    batch.old_logp = pool.compute_logprobs(batch)

    def boom(batch):  # rank 1 raises before its first forward; rank 0 goes on into the step's collectives
        raise RuntimeError("boom in rank 1")

    ray.get(pool.workers[1].__ray_call__.remote(lambda self: setattr(self, "_check_batch", boom)))
    t0 = time.monotonic()
    with pytest.raises(TrainerRankFailed, match="rank 1 failed during train_step: RuntimeError: boom") as info:
        pool.train_step(batch)
    assert time.monotonic() - t0 < 30 and info.value.killed
    assert isinstance(info.value.cause, RuntimeError)
    with pytest.raises(ray.exceptions.RayActorError):  # rank 0 was killed, not left in the collective
        ray.get(pool.workers[0].version.remote(), timeout=30)



@ray.remote(num_cpus=0)
class _StandInRank:
    """A rank of a pool call (`call_ranks`, whose idle ranks would keep the pool up): rank 0 fails as gloo fails a collective whose peer is gone; rank 1 dies a moment later
    (the order Ray may report them in when a rank is killed during a step: the peer's error first)."""

    def __init__(self, rank: int):
        self.rank = rank

    def train_step(self):
        if self.rank == 0:
            raise RuntimeError("gloo/transport/tcp/pair.cc: Read error: Connection reset by peer")
        time.sleep(0.5)
        os._exit(1)


def test_a_peers_collective_error_before_the_death_is_still_the_death(local_ray):
    """The death is reported even when a peer's collective error reaches the pool first (seen under load: a
    SIGKILLed rank 1, and rank 0's "connection reset by peer" returned before Ray saw rank 1 die)."""
    pool = TrainerPool.__new__(TrainerPool)  # stand-in ranks: only the pool's call path runs
    pool.workers = [_StandInRank.remote(r) for r in range(2)]
    with pytest.raises(TrainerRankDied) as info:
        pool.call_ranks(lambda rank: rank.train_step())
    assert info.value.rank == 1


def test_a_rank_out_of_disk_space_is_still_a_full_disk():
    from gspo_ray.trainer.checkpoints.durable import is_disk_full

    remote = ray.exceptions.RayTaskError("save", "Traceback ...", OSError(errno.ENOSPC, "No space left on device"))
    failed = TrainerRankFailed(1, "save", remote.as_instanceof_cause(), killed=True)
    assert is_disk_full(failed) and "rank 1 failed during save: OSError" in str(failed)
    assert not is_disk_full(TrainerRankFailed(1, "save", RuntimeError("boom"), killed=True))
