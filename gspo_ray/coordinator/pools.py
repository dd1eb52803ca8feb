"""Building the two pools from the job config; each gets only its own sub-config."""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gspo_ray.config import JobConfig
from gspo_ray.config.rollout import gpu_colocated, resolve_gpu_memory_utilization
from gspo_ray.coordinator.colocation import (bundle_shapes, engine_slots, free_slot, node_groups, rank_bundles,
                                             shares_trainer_gpus, visible_devices)
from gspo_ray.coordinator.rollout_pool import RolloutPool
from gspo_ray.rollout.weight_transfer import choose_weight_transfer, job_weight_transfer


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
        mt = cfg.rollout.multi_turn or cfg.rollout.agent  # episodes: their completion-token limit
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


def build_trainer_pool(cfg: JobConfig, model_path: Path, run_dir: Path, placement=None):
    """placement: a ColocatedPlacement whose bundles hold the ranks (None: the pool's own placement group)."""
    from gspo_ray.trainer.pool import TrainerPool

    trainer_cfg = trainer_pool_config(cfg)
    # the trainer scores tokens at the rollout's sampling temperature (log-probs of logits / T, as the engine)
    return TrainerPool(str(model_path), trainer_cfg, trainer_algorithm(cfg), str(run_dir),
                       temperature=cfg.rollout.temperature, placement=placement)


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


def build_rollout_pool(cfg: JobConfig, model_path: Path, run_dir: Path, factory=None, placement=None,
                       worker_cls=None) -> RolloutPool:
    """`factory(worker_id) -> actor` overrides how actors are made (used to inject a failing worker in tests).
    placement: a ColocatedPlacement; each engine then sits on its trainer ranks' GPUs and sleeps while they train.
    worker_cls: the actor's class (default RolloutWorker; tests stand in for a CUDA engine)."""
    import ray

    from gspo_ray.rollout.worker import RolloutWorker

    options = rollout_actor_options(cfg)
    actor_cls = ray.remote(worker_cls or RolloutWorker)
    rollout_cfg = rollout_config(cfg)

    def make(worker_id: int):
        if factory is not None:
            return factory(worker_id)
        if placement is None:
            return actor_cls.options(**options).remote(worker_id, str(model_path), rollout_cfg, str(run_dir),
                                                       reward_runner=rollout_cfg.reward)
        handle = actor_cls.options(**placement.engine_options(options, worker_id)).remote(
            worker_id, str(model_path), rollout_cfg, str(run_dir), reward_runner=rollout_cfg.reward, sleep_mode=True)
        placement.hold(worker_id, handle)
        return handle

    episodes = cfg.rollout.multi_turn is not None or cfg.rollout.agent is not None  # one Sample per episode
    return RolloutPool(make, cfg.rollout.num_workers, multi_turn=episodes,
                       call_timeout_s=cfg.rollout.call_timeout_s)


def build_pools(cfg: JobConfig, model_path: Path, run_dir: Path, rollout_factory=None):
    """(trainer pool, rollout pool), started together: their actors import torch, Megatron and vLLM and load the
    model at the same time (one after the other they took ~20 s + ~40 s of `make run`'s start-up on 2 cores).
    Colocated pools (both num_gpus_per_worker below 1) are placed first (ColocatedPlacement): the ranks in its
    bundles, each engine on its ranks' GPUs. If either fails, the other is shut down before the error propagates."""
    placement = None
    if gpu_colocated(cfg.rollout.num_gpus_per_worker, cfg.trainer.num_gpus_per_worker):
        placement = ColocatedPlacement(cfg)
        placement.check_transport(rollout_config(cfg).weight_transfer)
    with ThreadPoolExecutor(1, thread_name_prefix="rollout-pool-start") as ex:
        rollout_started = ex.submit(build_rollout_pool, cfg, model_path, run_dir, factory=rollout_factory,
                                    placement=placement)
        try:
            trainer = build_trainer_pool(cfg, model_path, run_dir, placement=placement)
        except BaseException:
            with contextlib.suppress(Exception):
                rollout_started.result().shutdown()
            if placement is not None:
                placement.remove()
            raise
    try:
        rollout = rollout_started.result()
    except BaseException:
        trainer.shutdown()
        if placement is not None:
            placement.remove()
        raise
    return trainer, rollout


def _bundle_device(_=None) -> tuple[str, list[str]]:
    """(Ray node id, GPU ids) of the bundle this runs in."""
    import ray

    return ray.get_runtime_context().get_node_id(), [str(i) for i in ray.get_gpu_ids()]


PROBE_GPUS = 0.001  # what the GPU-id probe takes of a bundle's GPU, for the moment it runs
SLOT_CHECK_S = 5.0  # how long a replacement waits for the engines already placed to show they are alive


class ColocatedPlacement:
    """The placement groups of colocated pools (coordinator/colocation.py for the layout): one STRICT_PACK group per
    node, a bundle {"GPU": 1} per trainer rank, the GPU ids Ray gave each bundle read once by a probe. The job owns
    it, not either pool (Ray kills the actors of a removed group); it goes with the job's Ray driver."""

    def __init__(self, cfg: JobConfig, timeout_s: float = 600):
        import ray
        from ray.util.placement_group import placement_group

        r, t = cfg.rollout, cfg.trainer
        tp = r.tensor_parallel_size
        node_gpus = sorted((int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")), reverse=True)
        self.groups = node_groups(t.num_workers, tp, node_gpus)
        self.ranks, self.slots = rank_bundles(self.groups), engine_slots(self.groups, tp)
        self.pgs = [placement_group(bundle_shapes(size, tp, t.num_cpus_per_worker, r.num_cpus_per_worker,
                                                  dict(t.resources), dict(r.resources)), strategy="STRICT_PACK")
                    for size in self.groups]
        self.held: dict[int, tuple[int, object]] = {}  # engine slot -> (worker id, actor handle) last placed there
        try:
            ray.get([pg.ready() for pg in self.pgs], timeout=timeout_s)
            probe = ray.remote(num_cpus=0, num_gpus=PROBE_GPUS)(_bundle_device)
            self.devices = [ray.get([probe.options(scheduling_strategy=self.strategy(g, b)).remote()
                                     for b in range(size)]) for g, size in enumerate(self.groups)]
        except BaseException:
            self.remove()
            raise

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def strategy(self, group: int, bundle: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.pgs[group], placement_group_bundle_index=bundle)

    def rank_strategy(self, rank: int):
        """Where trainer rank `rank` goes (TrainerPool): its own bundle, whose GPU it asks a fraction of."""
        return self.strategy(*self.ranks[rank])

    def engine_devices(self, slot: int) -> str:
        """CUDA_VISIBLE_DEVICES of the engine in `slot`: its ranks' GPUs."""
        s = self.slots[slot]
        return visible_devices([gpus for _, gpus in self.devices[s.group]], s)

    def engine_options(self, base: dict, worker_id: int) -> dict:
        """Ray options of rollout worker `worker_id` (`base`: rollout_actor_options): no GPU of its own, in the
        first bundle of a free engine slot, its GPUs named by CUDA_VISIBLE_DEVICES. Ray leaves that variable alone
        in an actor without GPUs unless RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO is set, so it is turned off here."""
        slot = self.free_slot()
        s = self.slots[slot]
        env = dict((base.get("runtime_env") or {}).get("env_vars", {}))
        env |= {"CUDA_VISIBLE_DEVICES": self.engine_devices(slot), "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
        self.held[slot] = (worker_id, None)
        return {**base, "num_gpus": 0, "scheduling_strategy": self.strategy(s.group, s.bundles[0]),
                "runtime_env": {**(base.get("runtime_env") or {}), "env_vars": env}}

    def hold(self, worker_id: int, handle) -> None:
        """Record the actor placed for `worker_id` (engine_options took its slot)."""
        for slot, (wid, _) in self.held.items():
            if wid == worker_id:
                self.held[slot] = (worker_id, handle)

    def free_slot(self) -> int:
        """A slot never used, else one whose engine is dead (a replacement); RuntimeError when every slot's engine
        is alive (a colocated pool cannot grow past its trainer's GPUs)."""
        import ray
        from ray.exceptions import RayActorError

        alive = {wid for wid, h in self.held.values() if h is None}  # placed this moment, not recorded yet
        pings = {wid: h.ping.remote() for wid, h in self.held.values() if h is not None}
        if len(self.held) == len(self.slots) and pings:
            ray.wait(list(pings.values()), num_returns=len(pings), timeout=SLOT_CHECK_S)
        for wid, ref in pings.items():
            try:
                ray.get(ref, timeout=0)
            except RayActorError:
                continue  # dead: its slot is free
            except Exception:  # noqa: BLE001 - starting, busy or wedged: it still holds its GPUs
                pass
            alive.add(wid)
        slot = free_slot(len(self.slots), {s: wid for s, (wid, _) in self.held.items()}, alive)
        if slot is None:
            raise RuntimeError(f"every GPU of the colocated pools holds a live engine ({len(self.slots)} engines of "
                               "rollout.tensor_parallel_size GPUs): the rollout pool cannot grow")
        return slot

    def check_transport(self, transport: str) -> str:
        """The transport every engine takes from where Ray put it: ipc only where each engine's GPUs (node, GPU id)
        are trainer ranks' GPUs. Raises ValueError (naming rollout.weight_transfer) where `transport` cannot reach
        an engine placed so."""
        ranks = {(node, gpu) for group in self.devices for node, gpus in group for gpu in gpus}
        node0 = self.devices[0][0][0]
        for s in self.slots:
            mine = {(self.devices[s.group][b][0], gpu) for b in s.bundles for gpu in self.devices[s.group][b][1]}
            chosen = choose_weight_transfer(transport, engine_on_gpu=True, trainer_on_gpu=True,
                                            same_gpu=shares_trainer_gpus(mine, ranks),
                                            same_node=self.devices[s.group][0][0] == node0)
            if transport == "auto":
                transport = chosen
        return transport

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self.pgs:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        self.pgs = []
