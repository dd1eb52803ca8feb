"""TrainerPool: N TrainerWorker Ray actors forming one torch.distributed / Megatron process group.

    pool = TrainerPool(model_dir, trainer_cfg, algo_cfg, run_dir)     # cfg.num_workers actors, cfg.tp / cfg.ep
    metrics = pool.train_step(batch)                                   # rank 0's metrics (equal on all ranks)
    export = pool.export_weights()                                     # rank 0's WeightExport
    pool.end_batch()                                                   # the rollout batch's passes are done
    pool.save(run_dir / "ckpt" / "step_10"); pool.load(...); pool.shutdown()

The actors are placed in one placement group (bundle i = rank i, packed). The master address and port of the
process group are taken on the node of bundle 0 (rank 0) before any actor starts. Every call fans out to all
ranks (each rank runs the same collective) and returns rank 0's result; the mini-batch is put into the object
store once and shared by all ranks.

A rank that dies (its process or node lost) fails the call at once with TrainerRankDied: the surviving ranks, which
would wait in a collective on it for `collective_timeout_s`, are killed right away, so the job can rebuild the pool
(`restart`, same or another size) from its last checkpoint without waiting.

An error inside a rank (an exception, not a death: a CUDA OOM, a full disk, a bug) is handled the same way: the
other ranks, blocked in a collective on the failed one, are killed at once and the call raises TrainerRankFailed
naming that rank and carrying its exception (`cause`; `is_disk_full` still finds an ENOSPC in it). Only when every
rank raised within ERROR_GRACE_S (the same bad argument everywhere, before any collective) does the pool stay up;
for a push (`call_ranks`), every rank idle within ERROR_GRACE_S is enough.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from gspo_ray.data.records import TrainBatch

if TYPE_CHECKING:  # the driver never needs Megatron itself: the actors import it
    from gspo_ray.trainer.weights.weight_export import WeightExport

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


class TrainerRankDied(RuntimeError):
    """A trainer rank's actor died during a pool call; every other rank of the pool has been killed too."""

    def __init__(self, rank: int, method: str, cause: BaseException):
        super().__init__(f"trainer rank {rank} died during {method} ({type(cause).__name__}); the pool's other ranks "
                         "were killed")
        self.rank, self.method = rank, method


class TrainerRankFailed(RuntimeError):
    """An exception inside one trainer rank during a pool call (the first one to arrive). `cause` is the rank's own
    exception; `killed`: whether the pool's ranks were killed (they would have waited on this one in a collective),
    so that the pool must be restarted before its next call."""

    def __init__(self, rank: int, method: str, cause: BaseException, killed: bool):
        remote = getattr(cause, "cause", None) or cause  # a RayTaskError carries the rank's exception as `cause`
        first = (str(remote).strip().splitlines() or [""])[-1]
        super().__init__(f"trainer rank {rank} failed during {method}: {type(remote).__name__}: {first}"
                         + ("; the pool's ranks were killed" if killed else ""))
        self.rank, self.method, self.cause, self.killed = rank, method, remote, killed


ERROR_GRACE_S = 2.0  # after a rank's error, how long the others may take to finish (or raise) before being killed
PUSH_BACKSTOP_S = 60.0  # a push's ranks past rank 0's own bound (its watchdog, its gate) by this much are killed


class TrainerPool:
    """Handles to the trainer ranks; method calls are collective over all of them."""

    def __init__(self, model_path: str | Path, trainer_cfg, algo_cfg, run_dir: str | Path | None = None,
                 ready_timeout_s: float = 600, temperature: float = 1.0, placement=None):
        """temperature: the rollout's sampling temperature; the trainer's log-probs are those of logits / T.
        placement: bundles made by the job (coordinator/pools.ColocatedPlacement: `rank_strategy(rank)`, shared with
        colocated engines, never removed here); None = a placement group of the pool's own."""
        self.model_path, self.algo_cfg, self.run_dir = model_path, algo_cfg, run_dir
        self.placement, self.pg = placement, None
        self.ready_timeout_s, self.temperature = ready_timeout_s, temperature
        self.workers: list = []
        self._start(trainer_cfg)

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def restart(self, trainer_cfg=None) -> None:
        """Replace every rank with a fresh actor (same config, or `trainer_cfg`, e.g. another num_workers), at the
        model's initial weights: the caller loads a checkpoint next. The old ranks are killed, not asked to shut
        down: one may be dead and the others stuck in a collective on it."""
        self._release()
        self._start(trainer_cfg or self.cfg)

    def _start(self, trainer_cfg) -> None:
        model_path, algo_cfg, run_dir = self.model_path, self.algo_cfg, self.run_dir
        ready_timeout_s, temperature = self.ready_timeout_s, self.temperature
        self.cfg = trainer_cfg
        n = trainer_cfg.num_workers
        bundle = {"CPU": trainer_cfg.num_cpus_per_worker, **trainer_cfg.resources}
        if trainer_cfg.num_gpus_per_worker:
            bundle["GPU"] = trainer_cfg.num_gpus_per_worker
        if self.placement is not None and self.placement.num_ranks != n:
            raise ValueError(f"the colocated placement holds {self.placement.num_ranks} trainer ranks, not {n}")
        if self.placement is None:
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
        if self.placement is not None:
            return self.placement.rank_strategy(index)
        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=index)

    def _all(self, method: str, *args, keep_if_idle: bool = False, timeout_s: float | None = None, **kwargs) -> list:
        """Every rank's result. Results are taken as they come, so a dead rank is seen at once even while the
        others still wait on it in a collective; then they are killed (TrainerRankDied). keep_if_idle: see
        `call_ranks`. timeout_s: ranks not all done by then are killed (TrainerRankFailed, `killed`)."""
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        waiting = list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while waiting:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            done, waiting = ray.wait(waiting, num_returns=1, timeout=left)
            if not done:
                rank = refs.index(waiting[0])
                log.warning("trainer ranks %s still in %s after %.0f s: killing the pool's ranks",
                            [refs.index(r) for r in waiting], method, timeout_s)
                self._kill_workers()
                raise TrainerRankFailed(rank, method, TimeoutError(f"no answer in {timeout_s} s"), killed=True)
            try:
                ray.get(done[0])
            except RayActorError as e:
                rank = refs.index(done[0])
                log.warning("trainer rank %d died during %s: killing the other %d ranks", rank, method,
                            len(refs) - 1)
                self._kill_workers()
                raise TrainerRankDied(rank, method, e) from e
            except Exception as e:  # an error inside a rank: the others may be stuck in a collective on it
                rank = refs.index(done[0])
                killed, dead = self._stop_after_error(refs, waiting, keep_if_idle)
                if dead is not None:  # the error was a collective's with a rank that died (gloo: connection reset)
                    rank, cause = dead
                    log.warning("trainer rank %d died during %s: killed the other %d ranks", rank, method,
                                len(refs) - 1)
                    raise TrainerRankDied(rank, method, cause) from cause
                log.warning("trainer rank %d failed during %s%s: %s", rank, method,
                            ": killed the pool's ranks" if killed else "", e)
                raise TrainerRankFailed(rank, method, e, killed) from e
        return ray.get(refs)

    def _stop_after_error(self, refs: list, waiting: list, keep_if_idle: bool = False
                          ) -> tuple[bool, tuple[int, RayActorError] | None]:
        """After one rank's error: unless every rank raises within ERROR_GRACE_S (an error all ranks hit alike,
        e.g. a bad argument, leaves them all idle and in step), kill them all. keep_if_idle: every rank having
        returned (raised or not) within ERROR_GRACE_S is enough. Returns whether they were killed, and (rank, error)
        of a rank whose actor died meanwhile: a rank killed from outside makes its peers' collectives fail (gloo's
        "connection reset by peer"), and that error may arrive before Ray reports the death; the death is the
        cause."""
        if waiting:
            _, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=ERROR_GRACE_S)
        failed = 0
        for rank, ref in enumerate(refs):
            if ref in waiting:
                continue
            try:
                ray.get(ref, timeout=0)
            except RayActorError as died:
                self._kill_workers()
                return True, (rank, died)
            except Exception:  # noqa: BLE001 - a rank's own error: counted
                failed += 1
        if not waiting and (keep_if_idle or failed == len(refs)):  # all returned: idle, or all raised (in step)
            return False, None
        self._kill_workers()
        return True, None

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

    def export_weights(self, bucket_mb: float | None = None, as_refs: bool = False,
                       shared: bool = False) -> WeightExport:
        """Rank 0's export; with as_refs its buckets are object refs owned by rank 0, with shared a record of its
        shared-memory file (see TrainerWorker)."""
        return self._rank0("export_weights", bucket_mb, as_refs=as_refs, shared=shared)

    def send_by_transfer(self, key, init_infos: list, client, timeout_s: float | None = None) -> None:
        """One push through vLLM's nccl / ipc backend, every rank (weights/weight_send.send_on_rank in each rank's
        actor; rank 0's vLLM sender drives the engines through `client`). timeout_s: rollout.push_timeout_s, the
        bound rank 0's watchdog keeps; the pool's own wait is a backstop PUSH_BACKSTOP_S behind it (ranks stuck
        past it are killed: a trainer recovery)."""
        from gspo_ray.trainer.weights.weight_send import send_on_rank

        self.call_ranks(send_on_rank, key, init_infos, client, timeout_s,
                        timeout_s=None if timeout_s is None else timeout_s + PUSH_BACKSTOP_S)

    def call_ranks(self, fn, *args, timeout_s: float | None = None) -> list:
        """`fn(rank's TrainerWorker, *args)` on every rank (Ray's `__ray_call__`), collective like every pool call,
        for a call that changes no weight or optimizer state of the ranks (a push: they only send): a rank's error
        that leaves every rank idle within ERROR_GRACE_S (none is stuck in a collective on it; e.g. trainer rank 0's
        EngineTransferError, an engine's fault, where the other ranks' sources need no gather) keeps the pool up:
        TrainerRankFailed with `killed` False, the ranks fit for the next call."""
        return self._all("__ray_call__", fn, *args, keep_if_idle=True, timeout_s=timeout_s)

    def rank0_address(self) -> tuple[str, int]:
        """(trainer rank 0's node IP, a port free there): the NCCL rendezvous of nccl pushes."""
        return ray.get(self.workers[0].__ray_call__.remote(rendezvous_address))

    def version(self) -> int:
        return self._rank0("version")

    def end_batch(self) -> None:
        """The current rollout batch's passes are done: every rank forgets its routing records (R2, drift)."""
        self._all("end_batch")

    def routing_record_bytes(self) -> list[int]:
        """Bytes of routing records each rank holds, in rank order."""
        return self._all("routing_record_bytes")

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

    def dead_ranks(self, timeout_s: float = 10.0) -> list[int]:
        """Ranks whose actor is dead (a cheap call to each; one that does not answer in time counts as alive)."""
        refs = [w.version.remote() for w in self.workers]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        dead = []
        for rank, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0)
            except RayActorError:
                dead.append(rank)
            except Exception:  # noqa: BLE001 - busy or failed otherwise: not dead
                pass
        return dead

    def _kill_workers(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)

    def _release(self) -> None:
        self._kill_workers()
        if getattr(self, "pg", None) is not None:
            remove_placement_group(self.pg)
            self.pg = None
        self.workers = []


def rendezvous_address(_actor) -> tuple[str, int]:
    """(this node's IP, a free port): below the ephemeral range like the trainer's own ports (parallel.free_port),
    not bind(0)'s, which the kernel hands to the next outgoing connection before the rendezvous listens."""
    from gspo_ray.trainer.parallel import free_port

    return ray.util.get_node_ip_address(), free_port()
