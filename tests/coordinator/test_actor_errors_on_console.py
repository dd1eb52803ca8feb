"""An actor's failure reaches the driver's console in one readable block, though jobs start Ray with
`log_to_driver=False`: the CLI's error line is followed by the remote traceback's last lines (the raising frame and
the exception), and a rollout worker that dies during a push is logged with Ray's death cause. Real Ray (the
package's shared instance), stand-in actors."""
from __future__ import annotations

import logging
import sys

import pytest
import ray

from gspo_ray.cli.errors import report_unexpected
from gspo_ray.coordinator.rollout_pool import RolloutPool
from tests.coordinator import stand_ins
from tests.coordinator.stand_ins import StandInRolloutWorker


def read_shards(path):
    raise RuntimeError(f"CUDA error: out of memory while loading {path}")


def load_weights(path, depth=8):  # a deep stack, as an engine's start has: the error is at the end of the text
    return read_shards(path) if depth == 0 else load_weights(path, depth - 1)


class EngineThatCannotStart:
    def __init__(self):
        load_weights("/models/qwen3-30b-a3b/model-00007.safetensors")

    def ping(self):
        return 0


@pytest.fixture(scope="module", autouse=True)
def _stand_ins_travel():
    for module in (sys.modules[__name__], stand_ins):  # the stand-in classes travel to the actors
        ray.cloudpickle.register_pickle_by_value(module)


@pytest.mark.usefixtures("local_ray")
def test_an_actor_that_died_starting_is_shown_with_its_exception(capsys):
    actor = ray.remote(num_cpus=0, max_restarts=0)(EngineThatCannotStart).remote()
    with pytest.raises(ray.exceptions.RayActorError) as died:
        ray.get(actor.ping.remote(), timeout=120)
    try:  # what the job raises around it (coordinator/job.py: TrainerFailed from the actor's error)
        raise RuntimeError(f"a worker died and could not be replaced ({died.value}); last checkpoint: None") \
            from died.value
    except RuntimeError as e:
        report_unexpected(e)
    err = capsys.readouterr().err
    block = err.split("the actor's side:\n", 1)[1].splitlines()
    assert len(block) <= 16 and all(line.startswith("    ") for line in block), err
    assert any("RuntimeError: CUDA error: out of memory while loading /models/qwen3" in line for line in block), err
    assert any("in read_shards" in line for line in block), err  # the raising frame, on its own line


@pytest.mark.usefixtures("local_ray")
def test_a_rollout_worker_that_died_under_a_push_is_logged_with_its_cause(caplog):
    actor = ray.remote(num_cpus=0, max_restarts=0)(StandInRolloutWorker)
    pool = RolloutPool(lambda wid: actor.remote(wid, dies_under_push=(1,)), 2, call_timeout_s=60)
    try:
        with caplog.at_level(logging.WARNING, logger="gspo_ray.coordinator.rollout_pool"):
            pool.push_weights(1, {"w": [0.0]})
        assert pool.num_workers == 1
        died = [r.getMessage() for r in caplog.records if "rollout worker 1 died" in r.getMessage()]
        assert died and "Its error:\n" in died[0] and "exit" in died[0].split("Its error:\n", 1)[1].lower(), died
    finally:
        pool.shutdown()
