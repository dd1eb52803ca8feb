"""The pool-size controller's rules, on measured numbers alone (no Ray): the window, the cool-down, bounds, the
device budget, trainer sizes the layout refuses, a move's cost, the staleness gate, giving back idle workers,
and a move that did not pay is not repeated."""
from __future__ import annotations

from dataclasses import replace

import pytest

from gspo_ray.config.autoscale import AutoscaleConfig, PoolBounds
from gspo_ray.coordinator.autoscale import Autoscaler, Pools, StepTimes


def scaler(mode="async", rollout=(1, 4), trainer=(1, 1), max_devices=None, problem=None, **cfg) -> Autoscaler:
    c = AutoscaleConfig(rollout=PoolBounds(min=rollout[0], max=rollout[1]),
                        trainer=PoolBounds(min=trainer[0], max=trainer[1]),
                        max_devices=max_devices, **{"window_steps": 2, "cooldown_steps": 3, **cfg})
    return Autoscaler(c, Pools(rollout=rollout, trainer=trainer, max_devices=max_devices, mode=mode,
                               trainer_problem=problem or (lambda n: None)))


def feed(s: Autoscaler, steps: int, r: int, t: int, rollout_s: float, train_s: float, sync_s: float = 0.0,
         start: int = 0, **kw) -> None:
    """`steps` steps of 10 completions each at sizes r/t, one second of job clock apart."""
    for i in range(steps):
        s.observe(StepTimes(r, t, rollout_s, train_s, sync_s, 10, at_s=float(start + i), **kw))


def test_measures_a_full_window_first():
    s = scaler()
    feed(s, 1, 1, 1, rollout_s=10, train_s=1)
    d = s.decide(step=1, now_s=1, steps_left=100)
    assert d.action == "hold" and "measuring: 1 of 2" in d.reason and (d.rollout_workers, d.trainer_workers) == (1, 1)


def test_async_rollout_bottleneck_grows_the_rollout_pool():
    s = scaler()
    feed(s, 2, 1, 1, rollout_s=10, train_s=2)
    d = s.decide(step=2, now_s=2, steps_left=100)
    assert (d.action, d.rollout_workers, d.trainer_workers) == ("grow", 2, 1), d.reason
    assert d.predicted > d.throughput * 1.05 and d.cost_s == 30.0
    assert d.throughput == pytest.approx(1.0)  # 10 completions / 10 s: async takes the slower pool


def test_sync_mode_balances_phase_times_with_a_move():
    """Sync: rollout 10 s + train 1 s at 1/2; the budget is spent, so a trainer rank's devices go to rollout."""
    s = scaler(mode="sync", trainer=(1, 4), max_devices=3)
    feed(s, 2, 1, 2, rollout_s=10, train_s=1)
    d = s.decide(step=2, now_s=2, steps_left=100)
    assert (d.action, d.rollout_workers, d.trainer_workers) == ("move", 2, 1), d.reason
    assert "(sync)" in d.reason


def test_cool_down_in_steps_and_seconds():
    s = scaler(cooldown_s=100.0)
    feed(s, 2, 1, 1, rollout_s=10, train_s=2)
    s.applied(s.decide(step=2, now_s=2, steps_left=100), step=2, now_s=2, cost_s=5.0)
    feed(s, 3, 2, 1, rollout_s=5, train_s=2, start=3)  # one settling step + a full window, still rollout-bound
    d = s.decide(step=4, now_s=5, steps_left=100)
    assert d.action == "hold" and "cool-down: 2 steps" in d.reason
    d = s.decide(step=5, now_s=50, steps_left=100)  # steps are past, seconds are not
    assert d.action == "hold" and "cool-down" in d.reason
    d = s.decide(step=5, now_s=102, steps_left=100)
    assert d.action == "grow" and d.rollout_workers == 3, d.reason


def test_never_out_of_bounds():
    s = scaler(rollout=(2, 3))
    feed(s, 2, 3, 1, rollout_s=10, train_s=2)  # rollout-bound at its max
    assert s.decide(step=2, now_s=2, steps_left=100).action == "hold"
    s = scaler(rollout=(2, 3))
    feed(s, 2, 2, 1, rollout_s=0.1, train_s=10)  # idle rollout at its min: nothing to give back
    assert s.decide(step=2, now_s=2, steps_left=100).action == "hold"


def test_never_over_the_budget():
    s = scaler(max_devices=2)
    feed(s, 2, 1, 1, rollout_s=10, train_s=2)
    d = s.decide(step=2, now_s=2, steps_left=100)
    assert d.action == "hold" and "no move reachable pays" in d.reason
    s = scaler(max_devices=3)
    feed(s, 2, 1, 1, rollout_s=10, train_s=2)
    assert s.decide(step=2, now_s=2, steps_left=100).rollout_workers == 2


def test_refused_trainer_sizes_are_skipped():
    """ep 2: odd rank counts are refused by the layout rule; a train-bound job grows 2 -> 4, never to 3."""
    s = scaler(trainer=(1, 4), problem=lambda n: None if n % 2 == 0 else f"trainer.ep (2) must divide {n}")
    feed(s, 2, 1, 2, rollout_s=1, train_s=10)
    d = s.decide(step=2, now_s=2, steps_left=100)
    assert (d.action, d.trainer_workers) == ("grow", 4), d.reason


def test_a_move_is_charged_its_measured_cost():
    s = scaler(trainer=(1, 2))
    feed(s, 2, 1, 1, rollout_s=1, train_s=10)
    assert s.decide(step=2, now_s=2, steps_left=100).trainer_workers == 2  # the prior: 30 s, paid in ~7 steps
    s.costs["trainer"] = 10_000.0  # a measured resize that long never pays within the horizon
    d = s.decide(step=2, now_s=2, steps_left=100)
    assert d.action == "hold" and "no move reachable pays" in d.reason
    s.costs["trainer"] = 30.0
    assert s.decide(step=2, now_s=2, steps_left=2).action == "hold"  # two steps left: no time to pay it back


def test_no_rollout_growth_while_groups_go_stale():
    s = scaler()
    feed(s, 2, 1, 1, rollout_s=10, train_s=2, stale_dropped=3)
    d = s.decide(step=2, now_s=2, steps_left=100)
    assert d.action == "hold" and "dropped for staleness" in d.reason
    s = scaler()  # none dropped yet, but the trained groups were at the bound and more wait behind them
    s.pools = replace(s.pools, max_staleness=1)
    feed(s, 2, 1, 1, rollout_s=10, train_s=2, buffer_depth=4, staleness=1.0)
    d = s.decide(step=2, now_s=2, steps_left=100)
    assert d.action == "hold" and "staleness bound" in d.reason
    s = scaler()
    s.pools = replace(s.pools, max_staleness=1)
    feed(s, 2, 1, 1, rollout_s=10, train_s=2, buffer_depth=0, staleness=1.0)  # at the bound, nothing waiting
    assert s.decide(step=2, now_s=2, steps_left=100).action == "grow"


def test_an_idle_pool_gives_its_workers_back():
    s = scaler()
    feed(s, 2, 3, 1, rollout_s=1, train_s=10)  # async: the rollout waits on the trainer
    d = s.decide(step=2, now_s=2, steps_left=100)
    assert (d.action, d.rollout_workers) == ("shrink", 2), d.reason
    s = scaler(mode="sync")  # sync: every rollout second counts, a worker fewer costs more than the tolerance
    feed(s, 2, 3, 1, rollout_s=1, train_s=10)
    assert s.decide(step=2, now_s=2, steps_left=100).action == "hold"


def test_a_move_that_did_not_pay_is_not_repeated():
    s = scaler(cooldown_steps=1)
    feed(s, 2, 1, 1, rollout_s=10, train_s=2)
    grow = s.decide(step=2, now_s=2, steps_left=100)
    s.applied(grow, step=2, now_s=2, cost_s=5.0)
    feed(s, 3, 2, 1, rollout_s=10, train_s=2, start=3)  # a second engine bought nothing: 10 s a step still
    d = s.decide(step=5, now_s=5, steps_left=100)
    last = s.history[-1]
    assert last.paid is False and last.measured == pytest.approx(grow.throughput)
    assert last.outcome().startswith("the grow at step 2: 1 -> 1 completions/s measured") and \
        last.outcome().endswith("did not pay")
    assert s.scaling["rollout"] == 0.0  # measured: one more worker bought nothing
    m = s.metrics(d)
    assert m["autoscale/paid"] == 0.0 and m["autoscale/measured_after"] == pytest.approx(1.0)
    assert (d.action, d.rollout_workers) == ("shrink", 1), d.reason  # and gives the idle engine back
    s.applied(d, step=5, now_s=5, cost_s=0.0)
    feed(s, 3, 1, 1, rollout_s=10, train_s=2, start=6)
    s.decide(step=9, now_s=9, steps_left=100)  # judges the shrink (paid: nothing lost)
    s.scaling["rollout"] = 1.0  # even were the estimate to promise linear scaling again
    d = s.decide(step=9, now_s=9, steps_left=100)
    assert d.action == "hold" and "1/1 -> 2/1 did not pay" in d.reason, d.reason
    feed(s, 2, 1, 1, rollout_s=20, train_s=2, start=9)  # the workload drifted (completions twice as long)
    d = s.decide(step=11, now_s=11, steps_left=100)
    assert (d.action, d.rollout_workers) == ("grow", 2), d.reason


def test_a_refused_resize_is_not_asked_again_until_the_workload_drifts():
    s = scaler()
    feed(s, 2, 1, 1, rollout_s=10, train_s=2)
    d = s.decide(step=2, now_s=2, steps_left=100)
    s.refused(d, "the cluster has no room")
    again = s.decide(step=2, now_s=2, steps_left=100)
    assert again.action == "hold" or again.rollout_workers != d.rollout_workers


def test_gspo_ray_scale_by_hand_restarts_the_window():
    s = scaler()
    feed(s, 2, 1, 1, rollout_s=10, train_s=2)
    feed(s, 1, 2, 1, rollout_s=5, train_s=2)  # someone ran `gspo-ray scale rollout 2`
    d = s.decide(step=3, now_s=3, steps_left=100)
    assert d.action == "hold" and "measuring: 1 of 2" in d.reason and d.rollout_workers == 2
