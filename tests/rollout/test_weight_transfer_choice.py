"""rollout.weight_transfer (rollout/weight_transfer.py): the transport chosen per engine, vLLM's own init records for
its `nccl` / `ipc` backends built for real, the pool client's NCCL rank layout (its calls to every engine at once:
tests/coordinator/test_transfer_push.py), and the refusal of
a CUDA transport for CPU devices (`gspo-ray train`'s one line, exit 2, before Ray: tests/preflight/
test_rollout_parallel.py). Pure: no engine, no GPU."""
from __future__ import annotations

import pytest

from gspo_ray.config import RolloutConfig
from gspo_ray.rollout.weight_transfer import (EnginePoolClient, check_weight_transfer, choose_weight_transfer,
                                              engine_backend, ipc_init_info, nccl_init_infos)


@pytest.mark.parametrize("requested,engine_gpu,trainer_gpu,same_gpu,same_node,expected", [
    ("auto", False, False, False, True, "shm"),            # CPU, one node: as before the field
    ("auto", False, False, False, False, "object_store"),  # CPU, another node
    ("auto", True, True, True, True, "ipc"),               # CUDA, sharing the trainer's GPUs
    ("auto", True, True, False, True, "nccl"),             # CUDA, GPUs of its own on the same node
    ("auto", True, True, False, False, "nccl"),            # ... or on another node
    ("auto", True, False, False, True, "shm"),             # a CPU trainer exports to host memory
    ("object_store", False, False, False, True, "object_store"),
    ("nccl", True, True, True, True, "nccl"),              # asked for: kept where the devices allow it
])
def test_choice(requested, engine_gpu, trainer_gpu, same_gpu, same_node, expected):
    got = choose_weight_transfer(requested, engine_on_gpu=engine_gpu, trainer_on_gpu=trainer_gpu,
                                 same_gpu=same_gpu, same_node=same_node)
    assert got == expected
    assert engine_backend(got) == (got if got in ("nccl", "ipc") else "gspo_shm")


@pytest.mark.parametrize("requested,engine_gpu,trainer_gpu,same_gpu,same_node,message", [
    ("nccl", False, False, False, True, "rollout.weight_transfer 'nccl' moves CUDA tensors, but the engines are on "
                                        "CPU (rollout.num_gpus_per_worker 0) and the trainer is on CPU"),
    ("ipc", True, False, True, True, "but the trainer is on CPU (trainer.num_gpus_per_worker 0)"),
    ("ipc", True, True, False, True, "rollout.weight_transfer 'ipc' needs the engine on the trainer's GPUs"),
    ("shm", False, False, False, False, "rollout.weight_transfer 'shm' reaches engines on trainer rank 0's node"),
    ("rdma", False, False, False, True, "rollout.weight_transfer 'rdma' is not one of"),
])
def test_refusals_are_one_line_naming_the_field(requested, engine_gpu, trainer_gpu, same_gpu, same_node, message):
    with pytest.raises(ValueError) as e:
        choose_weight_transfer(requested, engine_on_gpu=engine_gpu, trainer_on_gpu=trainer_gpu, same_gpu=same_gpu,
                               same_node=same_node)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_config_field_is_documented_and_defaults_to_auto():
    assert RolloutConfig().weight_transfer == "auto"
    assert "nccl" in RolloutConfig.model_fields["weight_transfer"].description
    with pytest.raises(ValueError):
        RolloutConfig(weight_transfer="rdma")
    check_weight_transfer("auto", engine_on_gpu=False, trainer_on_gpu=False)  # today's CPU jobs pass


def test_init_records_are_vllms_own_and_address_every_engine_worker():
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    trainer, worker = nccl_init_infos("10.0.0.1", 29600, [2, 1, 4], packed_buffer_bytes=64 * 2**20)
    assert isinstance(trainer, NCCLTrainerInitInfo) and trainer.backend == "nccl" and trainer.is_sender
    assert trainer.world_size == 1 + 2 + 1 + 4 and trainer.packed_buffer_size_bytes == 64 * 2**20
    assert isinstance(worker, NCCLWeightTransferInitInfo) and worker.rank_offset == 1
    # what vLLM's NCCLTrainerWeightTransferEngine.trainer_init sends: its own payload of the worker record
    client = EnginePoolClient([None] * 3, [2, 1, 4])
    per_engine = [NCCLWeightTransferInitInfo(**d) for d in client.engine_init_infos(worker_init_payload(worker))]
    assert [i.rank_offset for i in per_engine] == [1, 3, 4]
    # vLLM ranks a worker rank_offset + its rank in the engine: every rank of the group once, the trainer at 0
    ranks = [i.rank_offset + r for i, n in zip(per_engine, [2, 1, 4]) for r in range(n)]
    assert sorted([0] + ranks) == list(range(trainer.world_size))
    assert all(i.packed == trainer.packed and i.packed_buffer_size_bytes == trainer.packed_buffer_size_bytes
               for i in per_engine)  # must-agree wire parameters
    with pytest.raises(ValueError, match="world_size"):
        EnginePoolClient([None], [2]).engine_init_infos(worker_init_payload(worker))
    ipc = ipc_init_info(rank=1, packed_buffer_bytes=2**26)
    assert isinstance(ipc, IPCTrainerInitInfo) and ipc.backend == "ipc" and not ipc.is_sender and ipc.packed
    assert IPCWeightTransferInitInfo(**EnginePoolClient([None], [1]).engine_init_infos({"packed": True})[0]).packed
    assert not ipc_init_info().packed  # unpacked: one handle per tensor


def test_a_cpu_engine_refuses_cuda_transports_before_vllm_starts(tmp_path):
    from gspo_ray.rollout.engine import RolloutEngine

    for transport in ("nccl", "ipc"):
        with pytest.raises(ValueError, match=f"rollout.weight_transfer '{transport}' needs a CUDA engine"):
            RolloutEngine(tmp_path / "no-model", run_dir=tmp_path / "run", weight_transfer=transport)
    assert not (tmp_path / "run").exists()  # refused before anything was set up
