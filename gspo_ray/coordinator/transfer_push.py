"""A push through vLLM's own CUDA backends (`rollout.weight_transfer` nccl / ipc): who calls whom, in which order.

    push = TransferPush("nccl", tensor_parallel_size=2, bucket_bytes=64 * 2**20)   # once per job
    metrics = push(rollout_pool, trainer_pool, version, probe)                    # every push

One push:
1. The trainer pool's `send_by_transfer` on every rank (a collective: the ranks gather Megatron's shards bucket by
   bucket, trainer/weight_send.py). Rank 0 holds vLLM's trainer-side engine, which drives the engines itself
   through the `ActorPoolClient` it was given (rollout/weight_transfer.py): every phase goes to every rollout actor
   at once (`RolloutWorker.weight_transfer_call`), since NCCL's rendezvous and broadcast block until every worker
   of the group has joined. On the first push, and whenever the pool's engines changed (scaled, replaced), the
   sender is started again: `init_weight_transfer_engine` (the NCCL rendezvous; for ipc the packing mode), then
   per push `start_weight_update`, `update_weights` (concurrent with the broadcast for nccl), `finish_weight_update`.
2. The rollout pool's `publish_weights`: each engine's probe check (as for `gspo_shm` pushes), then its version.

The weights never pass through this process; only the control calls and the init records do. Not run on a GPU
(docs/rollout-engines.md): on CPU the order and the fan-out are tested with Ray actors standing in for the engines
and for the trainer's sender (tests/coordinator/test_transfer_push.py).
"""
from __future__ import annotations

import time
from typing import Any

from gspo_ray.rollout.weight_transfer import CUDA_TRANSPORTS, ActorPoolClient, ipc_init_info, nccl_init_infos


class TransferPush:
    """The coordinator's side of nccl / ipc pushes for one job: the init records, rebuilt when the engine set
    changes (the key the trainer's sender is kept by: transport and the rollout workers' ids) or the trainer's
    ranks do (a recovered trainer pool starts its sender afresh)."""

    def __init__(self, transport: str, tensor_parallel_size: int, bucket_bytes: int) -> None:
        if transport not in CUDA_TRANSPORTS:
            raise ValueError(f"TransferPush serves nccl / ipc, got {transport!r} (gspo_shm pushes: push_weights)")
        self.transport, self.tp, self.bucket_bytes = transport, tensor_parallel_size, bucket_bytes
        self.key: tuple | None = None
        self.init_infos: list[Any] = []
        self._ranks: list = []

    def init_records(self, trainer, engine_workers: list[int]) -> list[Any]:
        """vLLM's trainer init record of every trainer rank (nccl: one group, trainer rank 0 + every engine
        worker, rendezvous at a free port on rank 0's node; ipc: the rank only)."""
        if self.transport == "ipc":
            return [ipc_init_info(rank=r) for r in range(trainer.num_workers)]
        address, port = trainer.rank0_address()
        return [nccl_init_infos(address, port, engine_workers, rank=r, packed_buffer_bytes=self.bucket_bytes)[0]
                for r in range(trainer.num_workers)]

    def __call__(self, rollout, trainer, version: int, probe=None) -> dict[str, float]:
        t0 = time.perf_counter()
        workers = dict(rollout.workers)
        ids = sorted(workers)
        engine_workers = [self.tp] * len(ids)
        key = (self.transport, tuple(ids))
        ranks = list(getattr(trainer, "workers", []))  # a recovered trainer pool: new ranks, maybe a new node
        if key != self.key or ranks != self._ranks:  # a new rendezvous (the trainer's sender restarts on the key)
            self.init_infos, self.key, self._ranks = self.init_records(trainer, engine_workers), key, ranks
        client = ActorPoolClient([workers[i] for i in ids], engine_workers, timeout_s=rollout.call_timeout_s)
        trainer.send_by_transfer(key, self.init_infos, client)
        t1 = time.perf_counter()
        metrics = rollout.publish_weights(version, probe)
        metrics.update({"sync/transfer_s": t1 - t0, "sync/push_s": time.perf_counter() - t0})
        return metrics
