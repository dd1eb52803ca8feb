"""Pure rules of tensor-parallel rollout engines (no engine): which executor an engine runs, how a CPU engine's
cores are split between its TP workers (`VLLM_CPU_OMP_THREADS_BIND`), what a rollout actor reserves, and where the
engine's ZMQ sockets go."""
from pathlib import Path

import pytest

from gspo_ray.config import JobConfig, RolloutConfig
from gspo_ray.coordinator.pools import engine_resources
from gspo_ray.rollout.engine import IN_PROCESS, MULTI_PROCESS, engine_mode, worker_core_binding
from gspo_ray.rollout.worker import default_cpu_cores


def test_one_device_runs_in_process_several_in_vllms_multi_process_executor():
    assert engine_mode(1) == IN_PROCESS and engine_mode(2) == MULTI_PROCESS and engine_mode(8) == MULTI_PROCESS


def test_each_tp_worker_gets_its_own_cores():
    assert worker_core_binding([0, 1], 2) == "0|1"
    assert worker_core_binding([3, 2, 1, 0], 2) == "0,1|2,3"
    assert worker_core_binding([4, 5, 6], 2) == "4|5"  # an odd core left idle, never shared
    assert worker_core_binding([0], 2) == "0|0"  # fewer cores than workers: shared (slow, but it starts)


def test_an_actor_reserves_a_device_per_tp_worker():
    assert engine_resources(RolloutConfig(tensor_parallel_size=2)) == {"num_cpus": 2, "num_gpus": 0}
    assert engine_resources(RolloutConfig(tensor_parallel_size=2, num_cpus_per_worker=4))["num_cpus"] == 4
    assert engine_resources(RolloutConfig(tensor_parallel_size=4, num_gpus_per_worker=1)) == {
        "num_cpus": 1, "num_gpus": 4}
    assert engine_resources(JobConfig().rollout) == {"num_cpus": 1, "num_gpus": 0}  # TP 1: as before


def test_workers_of_tp2_engines_get_disjoint_core_blocks():
    cfg = RolloutConfig(num_workers=2, tensor_parallel_size=2)
    assert [default_cpu_cores(i, cfg, cpu_count=4) for i in range(2)] == ["0,1", "2,3"]


def test_engine_sockets_fit_a_unix_socket_address(tmp_path):
    """vLLM's multi-process executor binds ZMQ sockets at VLLM_RPC_BASE_PATH/<uuid4>; under a run directory a few
    levels deep (pytest's tmp_path, a cluster home) that path passed the 107-byte limit of a Unix socket address and
    the TP 2 engine did not start. A short run directory keeps its sockets; a long one gets a short directory."""
    import uuid

    import zmq

    from gspo_ray.rollout.engine_env import build_engine_env

    short = build_engine_env("/runs/job/rollout-0", "0|1", on_cuda=False)
    assert short["VLLM_RPC_BASE_PATH"] == short["TMPDIR"] == "/runs/job/rollout-0/tmp"
    deep = tmp_path / ("d" * 60) / "rollout-0"
    env = build_engine_env(deep, "0|1", on_cuda=False)
    assert env["TMPDIR"] == str(deep / "tmp")  # temp files still in the run directory
    socket = zmq.Context.instance().socket(zmq.PUSH)
    try:
        (deep / "tmp").mkdir(parents=True)
        with pytest.raises(zmq.ZMQError, match="longer than"):  # what the engine met
            socket.bind(f"ipc://{deep / 'tmp'}/{uuid.uuid4()}")
        Path(env["VLLM_RPC_BASE_PATH"]).mkdir(parents=True, exist_ok=True)
        socket.bind(f"ipc://{env['VLLM_RPC_BASE_PATH']}/{uuid.uuid4()}")
    finally:
        socket.close(linger=0)
