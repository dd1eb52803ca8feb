"""A push through vLLM's own CUDA backends (`rollout.weight_transfer` nccl / ipc): who calls whom, in which order.

    push = TransferPush("nccl", tensor_parallel_size=2, bucket_bytes=64 * 2**20)   # once per job
    metrics = push(rollout_pool, trainer_pool, version, probe)                    # every push

One push:
1. The trainer pool's `send_by_transfer` on every rank (a collective: the ranks gather Megatron's shards bucket by
   bucket, trainer/weights/weight_send.py). Rank 0 holds vLLM's trainer-side engine, which drives the engines itself
   through the `ActorPoolClient` it was given (rollout/weight_transfer.py): every phase goes to every rollout actor
   at once (`RolloutWorker.weight_transfer_call`), since NCCL's rendezvous and broadcast block until every worker
   of the group has joined. On the first push, and whenever the pool's engines changed (scaled, replaced), the
   sender is started again: `init_weight_transfer_engine` (the NCCL rendezvous; for ipc the packing mode), then
   per push `start_weight_update`, `update_weights` (concurrent with the broadcast for nccl), `finish_weight_update`.
2. The rollout pool's `publish_weights`: each engine's probe check (as for `gspo_shm` pushes), then its version.

New engines (the pool grown by `scale`, or replacing dead ones) get the live policy before they serve
(`push_new`, the pool's `on_new_workers` hook, set by the coordinator): once each answers, the same transfer to
these engines only (their own rendezvous: trainer rank 0 + their workers, ranks from 1), then their probe check and
the live version. The next regular push then starts the sender again with every engine (its key differs). Before
the job's first push nothing is sent: the engines serve the checkpoint they were built from, which is version 0.

An engine lost before a push (dead, or no `ping` answer in `rollout.call_timeout_s`) is dropped before the
rendezvous; one lost inside it fails the phase with EngineTransferError (rollout/weight_transfer.py), and the push
drops it and goes again, once, to the engines left. Every push is bounded by `rollout.push_timeout_s`: each phase's
wait on the engines, and trainer rank 0's watchdog (trainer/push_guard.py), which aborts a broadcast still
pending when an engine's side has failed or the bound has passed, so a death inside the broadcast is an error
within the bound, not a hang. Where the trainer's other ranks were stuck in its gathers (the
pool killed them) it raises TrainerRankDied instead: the job's trainer recovery.

The weights never pass through this process; only the control calls and the init records do. Not run on a GPU
(docs/rollout-engines.md): on CPU the order and the fan-out are tested with Ray actors standing in for the engines
and for the trainer's sender (tests/coordinator/test_transfer_push.py).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError

from gspo_ray.coordinator.rollout_pool import WORKER_DEATH
from gspo_ray.rollout.weight_transfer import (CUDA_TRANSPORTS, ActorPoolClient, engine_transfer_fault, ipc_init_info,
                                              nccl_init_infos)
from gspo_ray.trainer.pool import TrainerRankDied

log = logging.getLogger(__name__)


class TransferPush:
    """The coordinator's side of nccl / ipc pushes for one job: the init records, rebuilt when the engine set
    changes (the key the trainer's sender is kept by: transport and the rollout workers' ids) or the trainer's
    ranks do (a recovered trainer pool starts its sender afresh)."""

    def __init__(self, transport: str, tensor_parallel_size: int, bucket_bytes: int,
                 push_timeout_s: float = 900.0) -> None:
        if transport not in CUDA_TRANSPORTS:
            raise ValueError(f"TransferPush serves nccl / ipc, got {transport!r} (gspo_shm pushes: push_weights)")
        self.transport, self.tp, self.bucket_bytes = transport, tensor_parallel_size, bucket_bytes
        self.push_timeout_s = push_timeout_s  # rollout.push_timeout_s: every phase and trainer rank 0's watchdog
        self.pushes = 0
        self.key: tuple | None = None
        self.init_infos: list[Any] = []
        self._ranks: list = []
        self.live: tuple[int, Any] | None = None  # (version, probe) of the last push: what a new engine gets
        self.faults: list[BaseException] = []  # every push error that was an engine's (EngineTransferError inside)

    def init_records(self, trainer, engine_workers: list[int]) -> list[Any]:
        """vLLM's trainer init record of every trainer rank (nccl: one group, trainer rank 0 + every engine
        worker, rendezvous at a free port on rank 0's node; ipc: the rank only). Both packed in buckets of
        `bucket_bytes` (trainer.export_bucket_mb): an unpacked ipc push would hold a whole unsharded copy of the
        model on every trainer GPU until its finish."""
        if self.transport == "ipc":
            return [ipc_init_info(rank=r, packed_buffer_bytes=self.bucket_bytes) for r in range(trainer.num_workers)]
        address, port = trainer.rank0_address()
        return [nccl_init_infos(address, port, engine_workers, rank=r, packed_buffer_bytes=self.bucket_bytes)[0]
                for r in range(trainer.num_workers)]

    def __call__(self, rollout, trainer, version: int, probe=None) -> dict[str, float]:
        t0 = time.perf_counter()
        dropped = self._drop_lost(rollout)
        for attempt in (0, 1):
            workers = dict(rollout.workers)
            ids = sorted(workers)
            if not ids:  # every engine dropped (e.g. a discarded batch's): the pool's replacement gets this push
                break
            engine_workers = [self.tp] * len(ids)
            key = (self.transport, tuple(ids))
            ranks = list(getattr(trainer, "workers", []))  # a recovered trainer pool: new ranks, maybe a new node
            if key != self.key or ranks != self._ranks:  # a new rendezvous (the trainer's sender restarts on the key)
                self.init_infos, self.key, self._ranks = self.init_records(trainer, engine_workers), key, ranks
            client = ActorPoolClient([workers[i] for i in ids], engine_workers, timeout_s=self.push_timeout_s)
            try:
                trainer.send_by_transfer(key, self.init_infos, client, timeout_s=self.push_timeout_s)
                break
            except Exception as e:
                fault = engine_transfer_fault(e)
                if fault is None:
                    raise
                self.faults.append(e)
                lost = [ids[i] for i in fault.dead + fault.hung]
                rollout.drop_workers([ids[i] for i in fault.dead], [ids[i] for i in fault.hung])
                dropped += len(lost)
                if getattr(e, "killed", False):  # ranks left in the gathers, killed: the trainer is rebuilt
                    died = TrainerRankDied(getattr(e, "rank", 0), getattr(e, "method", "send_by_transfer"), e)
                    named = lost or [ids[i] for i in fault.failed]
                    died.add_note(f"rollout engine(s) {named} failed the push ({fault.method}); the other trainer "
                                  "ranks were stuck in its gathers and were killed")
                    raise died from e
                if attempt or not lost:  # one retry, and only to another engine set
                    raise
                log.warning("%s push of version %d: rollout engine(s) %s lost (%s); pushing again to the %d left",
                            self.transport, version, lost, fault, len(rollout.workers))
        self.live = (version, probe)  # before publish: a replacement started in it (push_new) gets this version
        t1 = time.perf_counter()
        self.pushes += 1
        if self.pushes == 1:
            self.check_first_push(t1 - t0)
        metrics = rollout.publish_weights(version, probe)
        metrics.update({"sync/transfer_s": t1 - t0, "sync/push_s": time.perf_counter() - t0,
                        "sync/engines_dropped": float(dropped)})
        return metrics

    def check_first_push(self, seconds: float) -> None:
        """The job's first push, measured, against rollout.push_timeout_s (the preflight only had an estimate):
        a warning when it took over half the bound, since a slower push (a busier network, a larger bucket
        backlog) would then be aborted."""
        if seconds > self.push_timeout_s / 2:
            log.warning("the first %s push took %.1f s, over half of rollout.push_timeout_s (%.0f s): raise "
                        "rollout.push_timeout_s, or pushes a little slower than this one will be aborted",
                        self.transport, seconds, self.push_timeout_s)

    def _drop_lost(self, rollout) -> int:
        """Before a push: every engine pinged (`ping` never waits on generation); a dead one is dropped and one
        with no answer in `call_timeout_s` killed as wedged (`RolloutPool.drop_workers`), so the rendezvous is
        not started with an engine that cannot join it. Returns how many were dropped."""
        refs = {wid: h.ping.remote() for wid, h in rollout.workers.items()}
        if not refs:
            return 0
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=rollout.call_timeout_s)
        dead, hung = [], []
        for wid, ref in refs.items():
            try:
                ray.get(ref, timeout=0)
            except GetTimeoutError:
                hung.append(wid)
            except WORKER_DEATH:
                dead.append(wid)
        rollout.drop_workers(dead, hung)
        return len(dead) + len(hung)

    def push_new(self, rollout, trainer, workers: dict[int, Any]) -> None:
        """Give engines about to join `rollout` ({worker id: handle}, not in `rollout.workers` yet) the live policy:
        nothing before the first push; else, once each engine answers (one that died starting raises the actor
        error the pool replaces it on), the last push's transfer to these engines alone, then their probe check
        (the last push's probe, None where it was not checked) and its version. Raises RuntimeError, sending
        nothing, if the trainer no longer holds that policy (a recovery or rescale under way); any other failure
        of the push goes on as it came (the pool stops the engines and notes their ids)."""
        if self.live is None:
            return
        version, probe = self.live
        ids = sorted(workers)
        held = trainer.version()
        if held != version:
            raise RuntimeError(f"rollout worker(s) {ids}: the trainer holds policy version {held}, the engines serve "
                               f"{version} (a trainer recovery or rescale under way): no live policy to send them")
        handles = [workers[i] for i in ids]
        ray.get([h.ping.remote() for h in handles], timeout=rollout.call_timeout_s)  # all up before the rendezvous
        engine_workers = [self.tp] * len(ids)
        # a key no full push has: the trainer starts a sender for these engines, and the next push one for all
        self.key, self._ranks = (self.transport, tuple(ids)), list(getattr(trainer, "workers", []))
        self.init_infos = self.init_records(trainer, engine_workers)
        client = ActorPoolClient(handles, engine_workers, timeout_s=self.push_timeout_s)
        trainer.send_by_transfer(self.key, self.init_infos, client, timeout_s=self.push_timeout_s)
        ray.get([h.publish_weights.remote(version, probe) for h in handles], timeout=rollout.call_timeout_s)
