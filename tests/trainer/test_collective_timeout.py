"""trainer.collective_timeout_s reaches the process group: a collective whose peer never joins fails after it."""
import time

import pytest

from gspo_ray.config import TrainerConfig
from _spawn import run_ranks

TIMEOUT_S = 3.0


def _stuck_peer(rank, world_size, ports, timeout_s):
    import torch
    import torch.distributed as dist

    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed

    init_distributed(rank, world_size, "127.0.0.1", ports[0], timeout_s=timeout_s)
    if rank == 1:  # a wedged rank: never reaches the all-reduce (exits once rank 0 has given up)
        time.sleep(timeout_s + 4)
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        outcome = "completed"
    except RuntimeError as e:  # gloo: "Timed out waiting ...ms for recv operation"
        outcome = str(e)
    elapsed = time.monotonic() - start
    destroy_distributed()
    return outcome, elapsed


@pytest.mark.slow
def test_collective_fails_after_configured_timeout():
    assert TrainerConfig().collective_timeout_s == 600  # was a fixed 120 s: too short for a real checkpoint save
    (outcome, elapsed), _ = run_ranks(_stuck_peer, 2, args=(TIMEOUT_S,), timeout_s=120)
    assert "Timed out" in outcome or "timeout" in outcome.lower(), outcome
    # fails at the configured bound, not at 120 s (wide margin for a loaded 2-core machine)
    assert TIMEOUT_S - 0.5 <= elapsed < TIMEOUT_S + 15, elapsed
