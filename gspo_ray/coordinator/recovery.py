"""In-job trainer recovery and live trainer scaling: one mechanism, rebuild the trainer pool and reload a checkpoint.

Recovery. A trainer rank (or its node) dies: the pool call fails at once with TrainerRankDied (the other ranks are
killed rather than left waiting on it in a collective for `trainer.collective_timeout_s`). The job then
  1. rebuilds the pool (fresh actors, same layout),
  2. drops what the coordinator produced since the checkpoint: the async batch in flight (sampled under versions the
     checkpoint never saw), waiting groups, partial carry, auto-eps band (`Coordinator.reset`),
  3. restores the last complete checkpoint exactly as `--resume` does (`restore_checkpoint`: loop state, prompt
     position, requeued prompts, waiting groups, partial carry, auto-eps, trainer weights + optimizer + RNG), or the
     job's initial state when no checkpoint exists yet (step 0, the initial weights),
  4. pushes the restored weights into every engine, drops the replayed steps' rows from metrics.jsonl (each step
     appears once in the final file; replayed rows carry `job/replayed` = 1), and goes on,
at most `trainer.max_restarts` times. What a user loses is the compute of the steps since the last checkpoint
(at most `coordinator.checkpoint_every`); the run's result does not change in kind (same checkpoint resume path).

Scaling (`gspo-ray scale trainer N`): at a step boundary the job saves a checkpoint, rebuilds the pool with N ranks
and loads it (model and optimizer state, the distributed optimizer's too, reshard to the new data-parallel size on
load, trainer/checkpoints/shards.py). The coordinator keeps its state: nothing is rewound, the async batch in flight
stays in flight. A layout tp/ep do not divide, or a size the cluster cannot place is refused before anything is saved or
stopped: `job/trainer_scale_refused` = 1 in the step's metrics, the reason in the log and in the job's control
status (`trainer_scale_refused`), and the job goes on at its size.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ray.exceptions import RayError

from gspo_ray.config import JobConfig
from gspo_ray.coordinator.checkpoint import CheckpointError, CheckpointManager
from gspo_ray.coordinator.loop import Coordinator, LoopState
from gspo_ray.coordinator.tracking import metric_rows
from gspo_ray.trainer.pool import TrainerRankDied

log = logging.getLogger(__name__)


def restore_checkpoint(coord: Coordinator, ckpts: CheckpointManager, path: Path) -> dict[str, float]:
    """The `--resume` path: loop state, prompt source position, coordinator state (requeued prompts, waiting
    groups, partial carry, auto-eps), then the trainer's weights, optimizer and RNG; the versions must agree. The
    engines get the restored policy. Returns the push's metrics."""
    coord.state, extra = ckpts.load_state(path)
    coord.prompts.load_state_dict(extra["prompts"])
    coord.load_state_dict(extra.get("coordinator", {}))
    version = coord.trainer.load(str(Path(path) / "trainer"))
    if version != coord.state.version:
        raise CheckpointError(f"{path}: trainer weights are at version {version}, the loop state at "
                              f"{coord.state.version}: not a consistent checkpoint")
    return coord.sync_weights()  # engines hold the base model or a newer policy: give them the restored one


@dataclass
class Recovery:
    """One in-job recovery, for metrics and the bench."""

    failed_at: int  # steps completed when the rank died
    restored_to: int  # the checkpoint's step (0: the initial state)
    seconds: float  # from the failed call to the restored policy pushed
    cause: str

    @property
    def steps_replayed(self) -> int:
        return self.failed_at - self.restored_to


@dataclass
class Resize:
    """What one resize did: the step's metrics, and why it was refused (None: applied, or already that size).
    The reason travels as a value to `gspo-ray scale` and the autoscaler, never through the log."""

    metrics: dict[str, float] = field(default_factory=dict)
    refused: str | None = None


@dataclass
class TrainerRecovery:
    """Rebuilds the job's trainer pool after a rank died (`recover`) or on a scaling request (`rescale`)."""

    cfg: JobConfig
    ckpts: CheckpointManager
    initial: dict = field(default_factory=dict)  # the loop's starting point when no checkpoint exists yet
    history: list[Recovery] = field(default_factory=list)
    replay_until: int = 0  # steps up to this one are replays of steps already run once
    _report: dict[str, float] = field(default_factory=dict)  # metrics for the next logged step
    scale_refused: dict | None = None  # the last refused resize: {"workers": n, "reason": "..."}

    @classmethod
    def for_job(cls, cfg: JobConfig, coord: Coordinator, ckpts: CheckpointManager) -> "TrainerRecovery":
        """Remember the loop's starting point (before its first step) for a death before the first checkpoint."""
        import dataclasses

        return cls(cfg, ckpts, initial={"state": dataclasses.asdict(coord.state), "prompts": coord.prompts.state_dict(),
                                        "coordinator": coord.state_dict()})

    @property
    def restarts(self) -> int:
        return len(self.history)

    # -- recovery ---------------------------------------------------------------------------------------------
    def is_trainer_death(self, coord: Coordinator, error: BaseException) -> bool:
        """A dead trainer rank: the pool said so, or an actor error (e.g. a weight push whose buckets were owned by
        a rank that died) left a rank that no longer answers."""
        if isinstance(error, TrainerRankDied):
            return True
        if isinstance(error, RayError):  # e.g. RayTaskError(OwnerDiedError) from a push of a dead rank's buckets
            return bool(coord.trainer.dead_ranks())
        return False

    def recover(self, coord: Coordinator, error: BaseException, summary) -> Path | None:
        """Rebuild the pool, rewind the coordinator to the last complete checkpoint (or the initial state), push
        its weights and trim metrics.jsonl. Returns the checkpoint restored (None: the initial state). Raises
        RestartsExhausted when `trainer.max_restarts` recoveries were made already."""
        if self.restarts >= self.cfg.trainer.max_restarts:
            raise RestartsExhausted(f"trainer.max_restarts={self.cfg.trainer.max_restarts} spent")
        t0, failed_at = time.perf_counter(), coord.state.step
        log.warning("trainer failure at step %d (%s): rebuilding the trainer pool (restart %d of %d)", failed_at + 1,
                    error, self.restarts + 1, self.cfg.trainer.max_restarts)
        coord.trainer.restart()  # fresh ranks at the initial weights, same layout
        pool_s = time.perf_counter() - t0
        latest = self.ckpts.latest()
        if latest is not None:
            coord.reset(LoopState())
            sync = restore_checkpoint(coord, self.ckpts, latest)
        else:  # no checkpoint yet: the job's start (version 0 = the weights a fresh pool holds)
            coord.reset(LoopState(**self.initial["state"]))
            coord.prompts.load_state_dict(self.initial["prompts"])
            coord.load_state_dict(self.initial["coordinator"])
            sync = coord.sync_weights()
        rec = Recovery(failed_at, coord.state.step, time.perf_counter() - t0, f"{type(error).__name__}: {error}")
        self.history.append(rec)
        self.replay_until = max(self.replay_until, failed_at)
        trim_metrics(self.cfg.run_dir / "metrics.jsonl", keep_through=coord.state.step)
        summary.eval_history[:] = [(s, r) for s, r in summary.eval_history if s <= coord.state.step]
        summary.checkpoint, summary.steps = latest, coord.state.step
        self._report.update({"job/trainer_restarts": self.restarts, "job/steps_replayed": rec.steps_replayed,
                             "job/recovery_s": rec.seconds, "job/recovery_pool_s": pool_s,
                             **{k: v for k, v in sync.items() if k.startswith("sync/verify")}})
        log.warning("trainer recovered in %.1f s from %s: %d steps to replay", rec.seconds,
                    latest or "the initial state", rec.steps_replayed)
        return latest

    def step_metrics(self, step: int) -> dict[str, float]:
        """Metrics to add to a step's row: the last recovery's (once), and `job/replayed` on replayed steps."""
        out, self._report = self._report, {}
        if step <= self.replay_until:
            out["job/replayed"] = 1.0
        return out

    # -- scaling ----------------------------------------------------------------------------------------------
    def rescale(self, coord: Coordinator, num_workers: int, save) -> Resize:
        """Resize the trainer pool at a step boundary: `save()` (-> the checkpoint of this step), rebuild at
        `num_workers` data-parallel ranks, reload it. The coordinator is not rewound. What `scale_problem` finds
        is refused before `save()` (logged, kept in `scale_refused`, returned; the pool stays as it is)."""
        from gspo_ray.coordinator.pools import trainer_pool_config

        old = coord.trainer.num_workers
        if num_workers == old:
            return Resize()
        reason = self.scale_problem(coord, num_workers)
        if reason is not None:
            log.error("scale trainer %d refused: %s", num_workers, reason)
            self.scale_refused = {"workers": num_workers, "reason": reason}
            return Resize({"job/trainer_scale_refused": 1.0}, reason)
        self.scale_refused = None
        new_cfg = trainer_pool_config(self.cfg, num_workers)
        t0 = time.perf_counter()
        path = save()
        old_cfg = coord.trainer.cfg
        try:
            coord.trainer.restart(new_cfg)
        except Exception as e:  # noqa: BLE001 - placing the new size failed: back to the old one, then report
            reason = f"placing {num_workers} ranks failed ({e}); restoring {old} ranks"
            log.exception("scale trainer %d refused: %s", num_workers, reason)
            coord.trainer.restart(old_cfg)
            new_cfg = None
            self.scale_refused = {"workers": num_workers, "reason": reason}
        version = coord.trainer.load(str(Path(path) / "trainer"))
        if version != coord.state.version:
            raise CheckpointError(f"{path}: trainer weights at version {version} after rescaling, the loop at "
                                  f"{coord.state.version}")
        # the engines hold these weights already; the push re-homes the pool's live-weights refs (owned by the
        # old rank 0, gone now), which a rollout worker started later would fetch
        sync = coord.sync_weights(verify=True)  # and checks the new pool's log-probs against the engines'
        log.info("trainer pool %d -> %d ranks in %.1f s", old, coord.trainer.num_workers, time.perf_counter() - t0)
        return Resize({"job/trainer_workers": coord.trainer.num_workers, "job/rescale_s": time.perf_counter() - t0,
                       **({} if new_cfg is not None else {"job/trainer_scale_refused": 1.0}),
                       **{k: v for k, v in sync.items() if k.startswith("sync/verify")}},
                      None if new_cfg is not None else reason)

    def scale_problem(self, coord: Coordinator, num_workers: int) -> str | None:
        """Why the pool cannot be resized to `num_workers` ranks (None: it can), checked before anything is saved
        or stopped: the layout and checkpoint rule (`TrainerConfig.resize_problem`, which the autoscaler reads
        too), then the cluster's room."""
        from gspo_ray.coordinator.pools import trainer_pool_config

        old_cfg, old = coord.trainer.cfg, coord.trainer.num_workers
        problem = old_cfg.resize_problem(num_workers)
        if problem is not None:
            return f"{problem}; the job goes on with {old} ranks"
        try:
            new_cfg = trainer_pool_config(self.cfg, num_workers)
        except ValueError as e:
            return str(e)
        if not _fits(old_cfg, old, new_cfg, num_workers):
            return (f"the cluster has no room for {num_workers} ranks of {new_cfg.num_cpus_per_worker} CPUs; the job "
                    f"goes on with {old} ranks")
        return None


class RestartsExhausted(RuntimeError):
    """The trainer died again after `trainer.max_restarts` in-job recoveries."""


def _fits(old_cfg, old_n: int, new_cfg, new_n: int) -> bool:
    """Whether the cluster's CPUs hold `new_n` ranks once the current pool's are released (GPUs likewise)."""
    import ray

    avail, total = ray.available_resources(), ray.cluster_resources()
    for key, per_old, per_new in (("CPU", old_cfg.num_cpus_per_worker, new_cfg.num_cpus_per_worker),
                                  ("GPU", old_cfg.num_gpus_per_worker, new_cfg.num_gpus_per_worker)):
        need = per_new * new_n
        if need and need > min(avail.get(key, 0) + per_old * old_n, total.get(key, 0)) + 1e-9:
            return False
    return True


def trim_metrics(path: Path, keep_through: int) -> None:
    """Drop metrics.jsonl rows of steps after `keep_through` (they are about to be replayed), atomically."""
    path = Path(path)
    if not path.exists():
        return
    keep = [row for row in metric_rows(path) if row["step"] <= keep_through]  # a cut-short row goes too
    tmp = path.with_name(path.name + ".trim")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in keep))
    os.replace(tmp, path)
