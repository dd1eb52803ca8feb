"""Building the two pools from the job config; each gets only its own sub-config."""
from __future__ import annotations

from pathlib import Path

from gspo_ray.config import JobConfig
from gspo_ray.coordinator.rollout_pool import RolloutPool


def build_trainer_pool(cfg: JobConfig, model_path: Path, run_dir: Path):
    from gspo_ray.trainer.pool import TrainerPool

    trainer_cfg = cfg.trainer
    if trainer_cfg.total_steps is None:  # the LR schedule's horizon: every optimizer step of the job
        c = cfg.coordinator
        trainer_cfg = trainer_cfg.model_copy(update={"total_steps": c.steps * c.num_iterations * c.num_minibatches})
    return TrainerPool(str(model_path), trainer_cfg, cfg.algorithm, str(run_dir))


def rollout_actor_options(cfg: JobConfig) -> dict:
    r = cfg.rollout
    return {"num_cpus": r.num_cpus_per_worker, "num_gpus": r.num_gpus_per_worker,
            "resources": dict(r.resources) or None, "max_restarts": 0, "max_task_retries": 0,
            "max_concurrency": 2}  # lets pause/ping reach a worker while it generates


def build_rollout_pool(cfg: JobConfig, model_path: Path, run_dir: Path, factory=None) -> RolloutPool:
    """`factory(worker_id) -> actor` overrides how actors are made (used to inject a failing worker in tests)."""
    import ray

    from gspo_ray.rollout.worker import RolloutWorker

    actor_cls = ray.remote(RolloutWorker).options(**rollout_actor_options(cfg))

    def make(worker_id: int):
        if factory is not None:
            return factory(worker_id)
        return actor_cls.remote(worker_id, str(model_path), cfg.rollout, str(run_dir), reward_runner=cfg.rollout.reward)

    return RolloutPool(make, cfg.rollout.num_workers, multi_turn=cfg.rollout.multi_turn is not None)
