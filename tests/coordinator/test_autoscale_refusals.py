"""A resize the cluster or the job refuses leaves the job running at sizes the controller knows.

- A rollout grow into a cluster with no room (real Ray, stand-in rollout actors that each take 2 of the shared
  instance's 5 CPUs) is refused within `rollout.placement_timeout_s`: the autoscaler holds and blocks the move, and
  `gspo-ray scale rollout N` gets the reason; before, the new actor stayed pending until `rollout.call_timeout_s`
  and its timeout failed the job.
- A move whose shrink was applied and whose grow was refused is recorded as the shrink it became, so the cool-down
  runs and the next window judges it (pure logic, a stand-in resize_pool).
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import ray

from gspo_ray.config import load_config
from gspo_ray.config.autoscale import AutoscaleConfig, PoolBounds
from gspo_ray.coordinator import autoscale_run
from gspo_ray.coordinator.autoscale import Autoscaler, Pools, StepTimes
from gspo_ray.coordinator.control import JobControl
from gspo_ray.coordinator.job import _apply_control
from gspo_ray.coordinator.loop import LoopState
from gspo_ray.coordinator.rollout_pool import RolloutPool
from tests.coordinator import stand_ins
from tests.coordinator.stand_ins import StandInRolloutWorker

RECIPE = "gspo_ray/recipes/tiny_moe.yaml"


def scaler(rollout=(1, 4), trainer=(1, 1), mode="async", **cfg) -> Autoscaler:
    c = AutoscaleConfig(rollout=PoolBounds(min=rollout[0], max=rollout[1]),
                        trainer=PoolBounds(min=trainer[0], max=trainer[1]), window_steps=2, cooldown_steps=3, **cfg)
    return Autoscaler(c, Pools(rollout=rollout, trainer=trainer, mode=mode))


def step_row(rollout_s: float, train_s: float) -> dict:
    """A step's metrics as the job's loop writes them (8 groups of 8 completions)."""
    return {"rollout/busy_s": rollout_s, "time/train_s": train_s, "time/sync_s": 0.0, "rollout/groups_trained": 8}


@pytest.mark.usefixtures("local_ray")
def test_a_rollout_grow_the_cluster_has_no_room_for_is_refused_in_seconds(tmp_path):
    cfg = load_config(RECIPE, [f"logging.out_dir={tmp_path}", "rollout.num_workers=2", "rollout.num_cpus_per_worker=2",
                               "rollout.placement_timeout_s=1", "rollout.call_timeout_s=20"])
    ray.cloudpickle.register_pickle_by_value(stand_ins)  # the stand-in class travels to the actors
    actor = ray.remote(num_cpus=2, max_restarts=0)(StandInRolloutWorker)
    pool = RolloutPool(actor.remote, 2, call_timeout_s=cfg.rollout.call_timeout_s)  # 4 of 5 CPUs: no room for a 3rd
    control = ray.remote(num_cpus=0)(JobControl).remote()
    try:
        pool.push_weights(1, {"w": [0.0]})  # a new worker gets the live weights first: the wait that never ended
        coord = SimpleNamespace(cfg=cfg, rollout=pool, trainer=SimpleNamespace(num_workers=1), buffer=[],
                                state=LoopState(step=2))
        s = scaler()
        s.observe(StepTimes(2, 1, rollout_s=10, train_s=2, sync_s=0, completions=64, at_s=1))  # rollout-bound
        metrics = step_row(10, 2)
        t0 = time.monotonic()
        d = autoscale_run.autoscale_step(s, coord, metrics, None, step=2, at_s=2)
        assert time.monotonic() - t0 < 10
        assert d.action == "hold" and "no room for 1 more rollout worker(s) of 2 CPU" in d.reason, d.reason
        assert "rollout.placement_timeout_s" in d.reason and pool.num_workers == 2
        assert (2, 1, 3, 1) in s.blocked and not s.history  # refused: not asked again until the workload drifts
        # `gspo-ray scale rollout 3`: the same refusal, as the answer the command prints
        request = ray.get(control.scale_rollout.remote(3))
        _apply_control(coord, control, {}, None)
        answer = ray.get(control.answer_of.remote(request))
        assert not answer["applied"] and "no room for 1 more rollout worker(s)" in answer["reason"]
        assert answer["size"] == 2 and pool.num_workers == 2
        assert ray.available_resources().get("CPU", 0) == pytest.approx(1)  # no pending actor, no group left
    finally:
        pool.shutdown()
        ray.kill(control)


def test_a_move_whose_grow_was_refused_keeps_its_shrink_with_a_cool_down(monkeypatch):
    """Sync, 1 rollout worker and 2 trainer ranks, the rollout 10x the train: the move 1/2 -> 2/1. The trainer
    shrink is applied, the rollout grow refused: the job runs at 1/1, which must be a recorded move."""
    coord = SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(group_size=8),
                                                coordinator=SimpleNamespace(steps=100)),
                            rollout=SimpleNamespace(num_workers=1), trainer=SimpleNamespace(num_workers=2), buffer=[])

    def resize_pool(coord, key, size, rescale_trainer):
        if key == "rollout_workers":
            return False, "the cluster has no room", {}
        coord.trainer.num_workers = size
        return True, "", {"job/trainer_workers": size}

    monkeypatch.setattr(autoscale_run, "resize_pool", resize_pool)
    s = Autoscaler(AutoscaleConfig(rollout=PoolBounds(min=1, max=2), trainer=PoolBounds(min=1, max=2),
                                   window_steps=2, cooldown_steps=5, max_devices=3),
                   Pools(rollout=(1, 2), trainer=(1, 2), max_devices=3, mode="sync"))
    s.observe(StepTimes(1, 2, rollout_s=10, train_s=1, sync_s=0, completions=64, at_s=1))
    d = autoscale_run.autoscale_step(s, coord, step_row(10, 1), None, step=2, at_s=2)
    assert (coord.rollout.num_workers, coord.trainer.num_workers) == (1, 1)
    assert (d.action, d.rollout_workers, d.trainer_workers) == ("shrink", 1, 1) and "refused" in d.reason, d.reason
    assert [(m.before, m.decision.trainer_workers) for m in s.history] == [((1, 2), 1)]  # recorded
    assert (1, 2, 2, 1) in s.blocked  # the refused move is not asked again until the workload drifts
    for step in (3, 4, 5):  # the settling step, then a full window at 1/1: still inside the cool-down
        d = autoscale_run.autoscale_step(s, coord, step_row(10, 2), None, step=step, at_s=step)
    assert d.action == "hold" and "cool-down" in d.reason, d.reason
