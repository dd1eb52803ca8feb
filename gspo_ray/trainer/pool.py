"""TrainerPool: N TrainerWorker Ray actors forming one torch.distributed / Megatron process group.

    pool = TrainerPool(model_dir, trainer_cfg, algo_cfg, run_dir)     # cfg.num_workers actors, cfg.tp / cfg.ep
    metrics = pool.train_step(batch)                                   # rank 0's metrics (equal on all ranks)
    export = pool.export_weights()                                     # rank 0's WeightExport
    pool.save(run_dir / "ckpt" / "step_10"); pool.load(...); pool.shutdown()

The actors are placed in one placement group (bundle i = rank i, packed). The master address and port of the
process group are taken on the node of bundle 0 (rank 0) before any actor starts. Every call fans out to all
ranks (each rank runs the same collective) and returns rank 0's result; the mini-batch is put into the object
store once and shared by all ranks.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from gspo_ray.data.records import TrainBatch

if TYPE_CHECKING:  # the driver never needs Megatron itself: the actors import it
    from gspo_ray.trainer.worker import WeightExport

log = logging.getLogger(__name__)


def omp_threads_env(num_threads: int | None) -> dict:
    """Actor options giving its process `num_threads` OpenMP threads from the start. Ray sets OMP_NUM_THREADS to
    the actor's num_cpus, and OpenMP's thread count is per OS thread: torch.set_num_threads in the constructor
    would not reach the threads Ray runs later calls on (vLLM's CPU attention then sees two different counts)."""
    if num_threads is None:
        return {}
    return {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(num_threads)}}}


def _master_address() -> tuple[str, int]:
    """(node IP, free port) of the node this runs on."""
    from gspo_ray.trainer.parallel import free_port

    return ray.util.get_node_ip_address(), free_port()


class TrainerPool:
    """Handles to the trainer ranks; method calls are collective over all of them."""

    def __init__(self, model_path: str | Path, trainer_cfg, algo_cfg, run_dir: str | Path | None = None,
                 ready_timeout_s: float = 600, temperature: float = 1.0):
        """temperature: the rollout's sampling temperature; the trainer's log-probs are those of logits / T."""
        self.cfg = trainer_cfg
        n = trainer_cfg.num_workers
        bundle = {"CPU": trainer_cfg.num_cpus_per_worker, **trainer_cfg.resources}
        if trainer_cfg.num_gpus_per_worker:
            bundle["GPU"] = trainer_cfg.num_gpus_per_worker
        self.pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
        ray.get(self.pg.ready(), timeout=ready_timeout_s)
        addr, port = ray.get(ray.remote(num_cpus=0)(_master_address).options(
            scheduling_strategy=self._on_bundle(0)).remote())
        from gspo_ray.trainer.worker import TrainerWorker

        actor_cls = ray.remote(TrainerWorker)
        self.workers = [
            actor_cls.options(
                num_cpus=trainer_cfg.num_cpus_per_worker, num_gpus=trainer_cfg.num_gpus_per_worker,
                resources=dict(trainer_cfg.resources) or None, scheduling_strategy=self._on_bundle(rank),
                **omp_threads_env(trainer_cfg.num_threads),
            ).remote(rank, n, addr, port, str(model_path), trainer_cfg, algo_cfg,
                     None if run_dir is None else str(run_dir), temperature=temperature)
            for rank in range(n)
        ]
        try:  # construction is collective; wait for every rank so a bad layout fails here, not in the first step
            ray.get([w.version.remote() for w in self.workers], timeout=ready_timeout_s)
        except Exception:
            self._release()
            raise
        log.info("trainer pool ready: %d ranks (tp=%d, ep=%d) at %s:%d", n, trainer_cfg.tp, trainer_cfg.ep, addr, port)

    def _on_bundle(self, index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=index)

    def _all(self, method: str, *args, **kwargs) -> list:
        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def _rank0(self, method: str, *args, **kwargs):
        return self._all(method, *args, **kwargs)[0]

    # ---- the verbs ---------------------------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch, eps: tuple[float, float] | None = None) -> dict[str, float]:
        """eps: (eps_low, eps_high) for this step (algorithm.eps auto); None = the configured band."""
        return self._rank0("train_step", ray.put(batch), eps=eps)

    def compute_logprobs(self, batch: TrainBatch, reference: bool = False, temperature: float | None = None,
                         purpose: str = "old_logprobs"):
        return self._rank0("compute_logprobs", ray.put(batch), reference=reference, temperature=temperature,
                           purpose=purpose)

    def export_weights(self, bucket_mb: float | None = None, as_refs: bool = False) -> WeightExport:
        """Rank 0's export; with as_refs its buckets are object refs owned by rank 0 (see TrainerWorker)."""
        return self._rank0("export_weights", bucket_mb, as_refs=as_refs)

    def version(self) -> int:
        return self._rank0("version")

    def save(self, ckpt_dir: str | Path) -> str:
        return self._rank0("save", str(ckpt_dir))

    def load(self, ckpt_dir: str | Path, load_optimizer: bool = True) -> int:
        return self._rank0("load", str(ckpt_dir), load_optimizer=load_optimizer)

    def shutdown(self) -> None:
        """Tear down the process group on every rank, then the actors and their placement group."""
        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        except Exception as e:  # a dead rank must not keep the others alive
            log.warning("trainer shutdown: %s", e)
        self._release()

    def _release(self) -> None:
        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.pg)
        self.workers = []
