"""`coordinator.autoscale`: the rollout and trainer pool sizes set from measured throughput (coordinator/autoscale.py).

Off by default (None). The objective is completions trained per second with `coordinator.max_staleness` held; the
sizes stay within each pool's bounds and the shared device budget, move only at step boundaries, through the same
path as `gspo-ray scale`, and wait out a cool-down between moves.
"""
from __future__ import annotations

from pydantic import Field, model_validator

from gspo_ray.config.base import Strict


class PoolBounds(Strict):
    """The sizes one pool may take, in workers (rollout: engines; trainer: ranks)."""

    min: int = Field(1, ge=1, description="fewest workers the autoscaler leaves the pool")
    max: int = Field(..., ge=1, description="most workers the autoscaler gives the pool")

    @model_validator(mode="after")
    def _ordered(self) -> "PoolBounds":
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) > max ({self.max})")
        return self


class AutoscaleConfig(Strict):
    """Bounds, budget, cool-down and measurement window of the pool-size controller."""

    rollout: PoolBounds = Field(..., description="rollout pool bounds (engines); rollout.num_workers is the start")
    trainer: PoolBounds | None = Field(None, description="trainer pool bounds (ranks); None = the trainer keeps "
                                       "trainer.num_workers. Sizes tp and ep do not divide are skipped")
    max_devices: float | None = Field(None, gt=0, description="device budget the two pools share: rollout "
                                      "workers x their devices + trainer ranks x theirs, where a worker's devices "
                                      "are its num_gpus_per_worker, or num_cpus_per_worker when it has no GPU. "
                                      "None = only the bounds limit the sizes")
    window_steps: int = Field(3, ge=1, description="k: steps measured at the current sizes before a decision "
                              "(the first step after a move, still half at the old sizes, is not counted)")
    cooldown_steps: int = Field(4, ge=1, description="steps after a move before the next one")
    cooldown_s: float = Field(0.0, ge=0, description="also at least this many seconds after a move (0 = steps only)")
    min_gain: float = Field(0.05, gt=0, description="a grow or move is made only when it is predicted to raise "
                            "completions trained per second by at least this share, after its cost")
    shrink_tolerance: float = Field(0.03, ge=0, description="a worker is given back (shrink) when the throughput "
                                    "predicted without it is at most this share lower")
    give_back: bool = Field(True, description="shrink a pool whose workers the throughput does not need, giving "
                            "their devices back to the cluster (a shared cluster); false = keep every device of "
                            "the sizes reached and only move them between the pools (a dedicated one)")
    horizon_steps: int = Field(20, ge=1, description="steps over which a move's measured cost (a rollout grow's "
                               "engine start, a trainer resize's save + rebuild + load) must be paid back by the "
                               "time it saves (fewer when the job has fewer steps left)")
    scaling_prior: float = Field(0.8, ge=0, le=1, description="per-pool scaling exponent assumed before a move "
                                 "measured it: n workers take (n0 / n)^e of the time n0 took (1 = linear)")
    move_cost_prior_s: float = Field(30.0, ge=0, description="seconds a move is assumed to cost (a rollout grow, "
                                     "whose engines start together; a trainer resize) before one was measured")
    max_move: int = Field(1, ge=1, description="most workers one decision adds to or takes from a pool (trainer: "
                          "layout steps); large clusters move several at once")

    def devices(self, per_worker_gpus: float, per_worker_cpus: float) -> float:
        """One worker's devices in the budget's units."""
        return per_worker_gpus if per_worker_gpus > 0 else per_worker_cpus


def autoscale_problem(job) -> str | None:
    """Why `coordinator.autoscale` cannot run this job (None: it can), naming the field: starting sizes outside
    the bounds, minimums over the budget, a trainer whose resize is refused by its layout or checkpoint, a
    worker bigger than the budget or than the local cluster's one node."""
    a = job.coordinator.autoscale
    if a is None:
        return None
    r, t = job.rollout, job.trainer
    dr = a.devices(r.num_gpus_per_worker, r.num_cpus_per_worker)
    dt = a.devices(t.num_gpus_per_worker, t.num_cpus_per_worker)
    trainer = a.trainer or type(a.rollout)(min=t.num_workers, max=t.num_workers)
    where = "coordinator.autoscale"
    least = a.rollout.min * dr + trainer.min * dt
    if a.max_devices is not None and least > a.max_devices + 1e-9:
        return (f"{where}.max_devices ({a.max_devices:g}) is below the minimums' devices: rollout.min "
                f"{a.rollout.min} x {dr:g} + trainer.min {trainer.min} x {dt:g} = {least:g}")
    for name, bounds, size in (("rollout", a.rollout, r.num_workers), ("trainer", trainer, t.num_workers)):
        if not bounds.min <= size <= bounds.max:
            return (f"{where}.{name}: {name}.num_workers ({size}) is outside [{bounds.min}, {bounds.max}]: the "
                    "job starts at its configured size")
    if a.trainer is not None and a.trainer.min < a.trainer.max:
        sizes = [n for n in range(a.trainer.min, a.trainer.max + 1) if n != t.num_workers]
        problems = [t.resize_problem(n) for n in sizes]
        if all(p is not None for p in problems):
            return (f"{where}.trainer: no size in [{a.trainer.min}, {a.trainer.max}] other than {t.num_workers} is "
                    f"one the trainer can be resized to ({problems[0]}); fix the bounds or that setting")
    start = r.num_workers * dr + t.num_workers * dt
    if a.max_devices is not None and start > a.max_devices + 1e-9:
        return (f"{where}.max_devices ({a.max_devices:g}) is below the starting sizes' devices ({start:g}: "
                f"rollout.num_workers {r.num_workers} x {dr:g} + trainer.num_workers {t.num_workers} x {dt:g})")
    node = job.cluster.num_cpus if job.cluster.address is None else None
    if node is not None:  # a local cluster is one node of cluster.num_cpus CPUs
        for name, per in (("rollout", r.num_cpus_per_worker), ("trainer", t.num_cpus_per_worker)):
            if per > node:
                return (f"{name}.num_cpus_per_worker ({per:g}) does not fit any node: the local cluster is one node "
                        f"of cluster.num_cpus {node}")
    return None
