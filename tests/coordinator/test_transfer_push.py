"""rollout.weight_transfer in the job: resolved once (a pure function), said in the engines line, and the coordinator's
dispatch of an nccl / ipc push (coordinator/transfer_push.py): which calls, in which order, every engine at once.

vLLM's nccl / ipc engines need CUDA on both sides, which this machine does not have, so the dispatch test runs the
real `RolloutPool`, `ActorPoolClient` and `TransferPush` over Ray actors that stand in for what cannot exist here:
`RecordingEngine` (a rollout actor's two transfer verbs, recording each call; every phase waits at a barrier until
all engines have entered it, so calls sent one engine after the other would time out) and `SenderStandIn` (the
trainer pool; its rank 0 calls the client in the order vLLM's `NCCLTrainerWeightTransferEngine` does:
`init_weight_transfer_engine` with vLLM's own worker payload when started, then start / update / finish per push).
"""
from __future__ import annotations

import time

import pytest
import ray

from gspo_ray.config import load_config
from gspo_ray.coordinator.pools import rollout_config
from gspo_ray.coordinator.rollout_pool import RolloutPool
from gspo_ray.coordinator.transfer_push import TransferPush
from gspo_ray.rollout.engine_env import describe_engines
from gspo_ray.rollout.weight_transfer import resolve_weight_transfer


@pytest.mark.parametrize("requested,rollout_gpus,trainer_gpus,expected", [
    ("auto", 0, 0, "shm"),              # CPU: gspo_shm, the file or refs per push as before (export_plan)
    ("auto", 1, 0, "shm"),              # a CPU trainer: host memory either way
    ("auto", 0, 1, "shm"),
    ("auto", 1, 1, "nccl"),             # whole GPUs never share: broadcast
    ("auto", 0.5, 1, "nccl"),
    ("auto", 0.5, 0.5, "ipc"),          # both fractional: Ray packs them onto one GPU
    ("object_store", 0, 0, "object_store"),
    ("nccl", 0.5, 0.5, "nccl"),         # an explicit value is kept
])
def test_resolve_weight_transfer(requested, rollout_gpus, trainer_gpus, expected):
    assert resolve_weight_transfer(requested, rollout_gpus=rollout_gpus, trainer_gpus=trainer_gpus) == expected


def test_lora_pushes_stay_on_the_trainers_export():
    assert resolve_weight_transfer("auto", rollout_gpus=1, trainer_gpus=1, lora=True) == "shm"
    with pytest.raises(ValueError, match="rollout.weight_transfer 'nccl' does not carry trainer.lora pushes"):
        resolve_weight_transfer("nccl", rollout_gpus=1, trainer_gpus=1, lora=True)


def test_resolution_reaches_the_workers_and_the_engines_line():
    assert rollout_config(load_config(None, [])).weight_transfer == "shm"
    cfg = load_config(None, ["rollout.num_gpus_per_worker=0.5", "trainer.num_gpus_per_worker=0.5"])
    assert rollout_config(cfg).weight_transfer == "ipc"
    with pytest.raises(ValueError, match="rollout.weight_transfer 'ipc' moves CUDA tensors"):
        resolve_weight_transfer("ipc", rollout_gpus=0, trainer_gpus=1)
    assert describe_engines(1, False, False, "shm").endswith(
        "gspo_shm: the shared-memory file on trainer rank 0's node, the object store elsewhere "
        "(rollout.weight_transfer shm)")
    assert "vLLM's nccl backend, sent from the trainer's shards" in describe_engines(2, False, True, "nccl")


@ray.remote(num_cpus=0)
class Barrier:
    def __init__(self):
        self.expected, self.seen = 0, {}

    def reset(self, expected: int) -> None:
        self.expected, self.seen = expected, {}

    def arrive(self, method: str) -> None:
        self.seen[method] = self.seen.get(method, 0) + 1

    def all_in(self, method: str) -> bool:
        return self.seen.get(method, 0) >= self.expected


@ray.remote(num_cpus=0)
class RecordingEngine:
    """Stands in for a RolloutWorker whose engine runs vLLM's nccl backend (CUDA only)."""

    def __init__(self, worker_id: int, barrier):
        self.worker_id, self.barrier, self.calls = worker_id, barrier, []

    def ping(self) -> int:
        return self.worker_id

    def weight_transfer_call(self, method: str, request=None) -> None:
        self.calls.append((method, request))
        ray.get(self.barrier.arrive.remote(method))
        deadline = time.monotonic() + 10
        while not ray.get(self.barrier.all_in.remote(method)):  # an NCCL rendezvous: everyone or nobody
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.worker_id}: not every engine entered {method}")
            time.sleep(0.01)

    def publish_weights(self, version: int, probe=None) -> dict[str, float]:
        self.calls.append(("publish_weights", (version, probe)))
        return {"sync/verify_max_abs_diff": 0.001 * (self.worker_id + 1)}

    def recorded(self) -> list:
        return self.calls

    def shutdown(self) -> None:
        pass


class SenderStandIn:
    """Stands in for the trainer pool: two ranks; rank 0 drives the client as vLLM's NCCL trainer engine does."""

    num_workers = 2

    def __init__(self, barrier):
        self.barrier, self.workers = barrier, ["rank0", "rank1"]
        self.key, self.sent = None, []

    def rank0_address(self):
        return "10.0.0.1", 29611

    def send_by_transfer(self, key, init_infos, client) -> None:
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

        self.sent.append((key, init_infos))
        ray.get(self.barrier.reset.remote(len(key[1])))
        info = init_infos[0]
        if key != self.key:  # trainer_init: vLLM's worker payload, rank_offset 1 after the single sender
            client.init_weight_transfer_engine(worker_init_payload(NCCLWeightTransferInitInfo(
                master_address=info.master_address, master_port=info.master_port, rank_offset=1,
                world_size=info.world_size, packed=info.packed,
                packed_buffer_size_bytes=info.packed_buffer_size_bytes,
                packed_num_buffers=info.packed_num_buffers)))
            self.key = key
        client.start_weight_update()
        client.update_weights(update_info(["w"]))
        client.finish_weight_update()


def update_info(names):
    return {"names": names, "dtype_names": ["float32"] * len(names), "shapes": [[2, 2]] * len(names)}


def test_nccl_push_calls_every_engine_at_once_in_vllms_order(local_ray):
    barrier = Barrier.remote()
    pool = RolloutPool(lambda wid: RecordingEngine.remote(wid, barrier), 2)
    trainer = SenderStandIn(barrier)
    push = TransferPush("nccl", tensor_parallel_size=2, bucket_bytes=2**20)
    m1 = push(pool, trainer, version=3, probe=None)
    m2 = push(pool, trainer, version=4, probe=None)
    assert m1["sync/verify_max_abs_diff"] == pytest.approx(0.002)  # the worst engine's check
    assert m2["sync/transfer_s"] <= m2["sync/push_s"]

    (key1, infos), (key2, infos2) = trainer.sent
    assert key1 == key2 == ("nccl", (0, 1)) and infos2 is infos  # one rendezvous while the engines stay
    assert [i.rank for i in infos] == [0, 1] and {i.world_size for i in infos} == {5}  # 1 trainer + 2 x TP 2
    assert {(i.master_address, i.master_port, i.packed_buffer_size_bytes) for i in infos} == {
        ("10.0.0.1", 29611, 2**20)}
    calls = ray.get([h.recorded.remote() for h in pool.workers.values()])
    for wid, engine_calls in enumerate(calls):
        methods = [c[0] for c in engine_calls]
        assert methods == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                           "finish_weight_update", "publish_weights",
                           "start_weight_update", "update_weights", "finish_weight_update", "publish_weights"]
        init = engine_calls[0][1]["init_info"]
        assert init["rank_offset"] == 1 + 2 * wid and init["world_size"] == 5  # engine 1 after engine 0's 2
        assert engine_calls[2][1] == {"update_info": update_info(["w"])}
        assert engine_calls[4][1] == (3, None) and engine_calls[8][1] == (4, None)

    pool.scale(1)  # a new engine set (worker 1 stopped): a new rendezvous, engine 0 alone in a world of 3
    push(pool, trainer, version=5, probe=None)
    key3, infos3 = trainer.sent[-1]
    assert key3 == ("nccl", (0,)) and {i.world_size for i in infos3} == {3}
    last = ray.get(pool.workers[0].recorded.remote())[-5:]
    assert [c[0] for c in last] == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                                    "finish_weight_update", "publish_weights"]
    assert last[0][1]["init_info"]["rank_offset"] == 1 and last[0][1]["init_info"]["world_size"] == 3
    pool.shutdown()


def test_ipc_records_and_a_non_cuda_transport_refused():
    push = TransferPush("ipc", tensor_parallel_size=1, bucket_bytes=2**20)
    infos = push.init_records(SenderStandIn(None), [1])
    assert [i.rank for i in infos] == [0, 1] and all(i.backend == "ipc" for i in infos)
    with pytest.raises(ValueError, match="nccl / ipc"):
        TransferPush("shm", tensor_parallel_size=1, bucket_bytes=1)
