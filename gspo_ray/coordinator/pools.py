"""Building the two pools from the job config; each gets only its own sub-config."""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gspo_ray.config import JobConfig
from gspo_ray.config.rollout import resolve_gpu_memory_utilization
from gspo_ray.coordinator.rollout_pool import RolloutPool
from gspo_ray.rollout.weight_transfer import job_weight_transfer


def auto_threads(cfg: JobConfig, num_workers: int, num_cpus_per_worker: float) -> int:
    """OpenMP threads per actor when the config leaves them unset. In sync mode on a local cluster rollout and
    training never run at once, so each pool's actors share all of the node's cores (a Ray actor with num_cpus=1
    would otherwise run one thread and leave the other cores idle); otherwise an actor keeps its reservation."""
    if cfg.coordinator.mode == "sync" and cfg.cluster.address is None:
        cores = cfg.cluster.num_cpus or os.cpu_count() or 1
        return max(1, cores // num_workers)
    return max(1, int(num_cpus_per_worker))


def trainer_algorithm(cfg: JobConfig):
    """The algorithm config the trainer gets. Dr.GRPO's `norm_len` defaults to the completion limit
    (rollout.max_new_tokens; multi_turn.max_total_tokens for episodes): a constant, never the batch's width."""
    algo = cfg.algorithm
    if algo.norm_len is None:
        mt = cfg.rollout.multi_turn
        algo = algo.model_copy(update={"norm_len": mt.max_total_tokens if mt else cfg.rollout.max_new_tokens})
    return algo


def trainer_pool_config(cfg: JobConfig, num_workers: int | None = None):
    """The trainer sub-config the pool gets: the LR horizon and `num_threads` resolved; `num_workers` overrides the
    configured size (live trainer scaling), its thread count re-derived when auto."""
    trainer_cfg = cfg.trainer
    if num_workers is not None and num_workers != trainer_cfg.num_workers:
        trainer_cfg = type(trainer_cfg).model_validate({**trainer_cfg.model_dump(), "num_workers": num_workers})
    if trainer_cfg.total_steps is None:  # the LR schedule's horizon: every optimizer step of the job
        c = cfg.coordinator
        trainer_cfg = trainer_cfg.model_copy(update={"total_steps": c.steps * c.num_iterations * c.num_minibatches})
    if trainer_cfg.lora is not None and cfg.rollout.num_gpus_per_worker > 0 and not trainer_cfg.lora.engines_on_cuda:
        # the engines serve an MoE's adapter on CUDA (config.lora.merged_push); the trainer must push the same
        trainer_cfg = trainer_cfg.model_copy(update={"lora": trainer_cfg.lora.model_copy(
            update={"engines_on_cuda": True})})
    if trainer_cfg.num_threads is None:
        trainer_cfg = trainer_cfg.model_copy(update={"num_threads": auto_threads(
            cfg, trainer_cfg.num_workers, trainer_cfg.num_cpus_per_worker)})
    return trainer_cfg


def build_trainer_pool(cfg: JobConfig, model_path: Path, run_dir: Path):
    from gspo_ray.trainer.pool import TrainerPool

    trainer_cfg = trainer_pool_config(cfg)
    # the trainer scores tokens at the rollout's sampling temperature (log-probs of logits / T, as the engine)
    return TrainerPool(str(model_path), trainer_cfg, trainer_algorithm(cfg), str(run_dir),
                       temperature=cfg.rollout.temperature)


def rollout_config(cfg: JobConfig):
    """The rollout sub-config the workers get: `num_threads` resolved (see auto_threads), and
    `gpu_memory_utilization` 'auto' sized by whether a trainer shares the engines' GPUs, `weight_transfer` 'auto'
    resolved (rollout/weight_transfer.job_weight_transfer)."""
    r = cfg.rollout
    if r.gpu_memory_utilization == "auto":
        r = r.model_copy(update={"gpu_memory_utilization": resolve_gpu_memory_utilization(
            "auto", r.num_gpus_per_worker, cfg.trainer.num_gpus_per_worker)})
    lora = cfg.trainer.lora
    if lora is not None and lora.serve == "adapter" and r.lora_rank is None:  # the engines serve the adapter
        r = r.model_copy(update={"lora_rank": lora.rank})
    if (cfg.trainer.routing_replay == "R3" or cfg.trainer.routing_agreement) and not r.capture_routes:
        r = r.model_copy(update={"capture_routes": True})  # the engines return the routing that sampled
    if r.weight_transfer == "auto":  # once, for every engine of the job and its pushes (coordinator/loop.py)
        r = r.model_copy(update={"weight_transfer": job_weight_transfer(cfg)})
    if r.num_threads is not None:
        return r
    return r.model_copy(update={"num_threads": auto_threads(cfg, r.num_workers, r.num_cpus_per_worker)})


def engine_resources(r) -> dict:
    """Ray resources of one rollout actor: an engine of tensor_parallel_size devices needs that many cores (CPU
    engines, one per TP worker) or GPUs, all on its node (an actor and its worker processes live on one node)."""
    tp = r.tensor_parallel_size
    if r.num_gpus_per_worker > 0:
        return {"num_cpus": r.num_cpus_per_worker, "num_gpus": max(r.num_gpus_per_worker, tp)}
    return {"num_cpus": max(r.num_cpus_per_worker, tp), "num_gpus": 0}


def rollout_actor_options(cfg: JobConfig) -> dict:
    from gspo_ray.trainer.pool import omp_threads_env

    r = rollout_config(cfg)
    return {**engine_resources(r),
            "resources": dict(r.resources) or None, "max_restarts": 0, "max_task_retries": 0,
            "max_concurrency": 2,  # lets pause/ping reach a worker while it generates
            **omp_threads_env(r.num_threads)}


def build_rollout_pool(cfg: JobConfig, model_path: Path, run_dir: Path, factory=None) -> RolloutPool:
    """`factory(worker_id) -> actor` overrides how actors are made (used to inject a failing worker in tests)."""
    import ray

    from gspo_ray.rollout.worker import RolloutWorker

    actor_cls = ray.remote(RolloutWorker).options(**rollout_actor_options(cfg))
    rollout_cfg = rollout_config(cfg)

    def make(worker_id: int):
        if factory is not None:
            return factory(worker_id)
        return actor_cls.remote(worker_id, str(model_path), rollout_cfg, str(run_dir), reward_runner=rollout_cfg.reward)

    return RolloutPool(make, cfg.rollout.num_workers, multi_turn=cfg.rollout.multi_turn is not None,
                       call_timeout_s=cfg.rollout.call_timeout_s)


def build_pools(cfg: JobConfig, model_path: Path, run_dir: Path, rollout_factory=None):
    """(trainer pool, rollout pool), started together: their actors import torch, Megatron and vLLM and load the
    model at the same time (one after the other they took ~20 s + ~40 s of `make run`'s start-up on 2 cores).
    If either fails, the other is shut down before the error propagates."""
    with ThreadPoolExecutor(1, thread_name_prefix="rollout-pool-start") as ex:
        rollout_started = ex.submit(build_rollout_pool, cfg, model_path, run_dir, factory=rollout_factory)
        try:
            trainer = build_trainer_pool(cfg, model_path, run_dir)
        except BaseException:
            with contextlib.suppress(Exception):
                rollout_started.result().shutdown()
            raise
    try:
        rollout = rollout_started.result()
    except BaseException:
        trainer.shutdown()
        raise
    return trainer, rollout
