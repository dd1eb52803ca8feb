"""The autoscaler in a running job: measure each step, decide at its boundary, resize through `gspo-ray scale`'s path.

A decision resizes with `control.resize_pool`, the function `gspo-ray scale` requests go through: rollout workers
are added (with the live weights) or retired once their calls of a batch in flight are back, a trainer resize saves,
rebuilds and reloads (coordinator/recovery.py), so nothing in flight is lost. A move shrinks its source pool
first, so the devices it frees are there for the other. Every decision is one log line and `autoscale/*` metrics
in the step's row (docs/autoscale.md).
"""
from __future__ import annotations

import logging
import time

from gspo_ray.config import JobConfig
from gspo_ray.coordinator.autoscale import Autoscaler, Decision, Pools, StepTimes
from gspo_ray.coordinator.control import resize_pool

log = logging.getLogger(__name__)


def autoscaler_for(cfg: JobConfig, trainer_problem) -> Autoscaler | None:
    """The job's controller (None when `coordinator.autoscale` is off). `trainer_problem(n)`: the running pool's
    `TrainerConfig.resize_problem`, which rules trainer sizes in or out."""
    a = cfg.coordinator.autoscale
    if a is None:
        return None
    r, t = cfg.rollout, cfg.trainer
    trainer = (a.trainer.min, a.trainer.max) if a.trainer is not None else (t.num_workers, t.num_workers)
    return Autoscaler(a, Pools(rollout=(a.rollout.min, a.rollout.max), trainer=trainer,
                               rollout_devices=a.devices(r.num_gpus_per_worker, r.num_cpus_per_worker),
                               trainer_devices=a.devices(t.num_gpus_per_worker, t.num_cpus_per_worker),
                               max_devices=a.max_devices, trainer_problem=trainer_problem,
                               mode=cfg.coordinator.mode,
                               max_staleness=cfg.coordinator.max_staleness if cfg.coordinator.mode == "async"
                               else None))


def step_times(metrics: dict, rollout_workers: int, trainer_workers: int, group_size: int, at_s: float,
               buffer_depth: int = 0) -> StepTimes:
    """A step's row -> what the controller measures. The rollout's time is its pool's busy time (`rollout/busy_s`,
    submit to the last call back), `rollout/gen_s` where that is missing; `rollout/tokens` (every generated
    completion's) is the work index the phases are compared per."""
    return StepTimes(rollout_workers, trainer_workers,
                     rollout_s=metrics.get("rollout/busy_s", metrics.get("rollout/gen_s", 0.0)),
                     train_s=metrics.get("time/train_s", 0.0), sync_s=metrics.get("time/sync_s", 0.0),
                     completions=int(metrics.get("rollout/groups_trained", 0)) * group_size, at_s=at_s,
                     stale_dropped=int(metrics.get("rollout/stale_dropped", 0)),
                     staleness=metrics.get("rollout/staleness_max_updates", 0.0),
                     tokens=int(metrics.get("rollout/tokens", 0)), buffer_depth=buffer_depth)


def autoscale_step(scaler: Autoscaler, coord, metrics: dict, rescale_trainer, step: int, at_s: float) -> Decision:
    """Observe the step just done, decide, act; the decision's metrics go into `metrics`."""
    c = coord.cfg
    scaler.observe(step_times(metrics, coord.rollout.num_workers, coord.trainer.num_workers,
                              c.rollout.group_size, at_s, buffer_depth=len(coord.buffer)))
    d = scaler.decide(step, at_s, c.coordinator.steps - step)
    if d.action != "hold":
        t0 = time.perf_counter()
        want = {"rollout_workers": d.rollout_workers, "trainer_workers": d.trainer_workers}
        now = {"rollout_workers": coord.rollout.num_workers, "trainer_workers": coord.trainer.num_workers}
        # shrinks first: a move's freed devices are there for the grow
        for key in sorted((k for k in want if want[k] != now[k]), key=lambda k: want[k] > now[k]):
            applied, reason, m = resize_pool(coord, key, want[key], rescale_trainer)
            metrics.update(m)
            if not applied:
                scaler.refused(d, reason)
                log.warning("autoscale step %d: %s %s -> %d refused: %s", step, d.action, key, want[key], reason)
                d = _after_refusal(scaler, d, coord, reason, step, at_s, time.perf_counter() - t0)
                break
        else:
            scaler.applied(d, step, at_s, cost_s=time.perf_counter() - t0)
            metrics["autoscale/move_s"] = time.perf_counter() - t0
    metrics.update(scaler.metrics(d))
    judged = [m for m in scaler.history if m.judged_at == step]  # the last move, measured at this boundary
    log.info("autoscale step %d: %s -> rollout %d, trainer %d: %s%s", step, d.action, d.rollout_workers,
             d.trainer_workers, d.reason, f" ({judged[0].outcome()})" if judged else "")
    return d


def _after_refusal(scaler: Autoscaler, d: Decision, coord, reason: str, step: int, at_s: float,
                   cost_s: float) -> Decision:
    """The decision that stands once part of `d` was refused. Nothing applied: a hold. A move whose shrink was
    applied before its grow was refused is kept and recorded as the shrink it became (a move in history, so the
    cool-down runs and the next window judges it like any shrink), not rolled back: undoing it costs a second
    resize now (a trainer save, rebuild and reload, or an engine start into room that was just found short), the
    price the move was predicted to pay back; if the shrink loses throughput, the usual rules grow the pool back
    once the cool-down is over."""
    now = (coord.rollout.num_workers, coord.trainer.num_workers)
    if now == scaler.sizes():
        return Decision("hold", *now, f"refused: {reason}", d.throughput, d.throughput)
    predicted = 1 / max(scaler.time_per_token(*now) * scaler.tokens_per_completion(), 1e-12)
    kept = Decision("shrink", *now, f"refused: {reason}; kept the {d.action}'s shrink to {now[0]}/{now[1]}",
                    d.throughput, predicted)
    scaler.applied(kept, step, at_s, cost_s=cost_s)
    return kept
