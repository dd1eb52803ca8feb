"""Shared fixtures for the coordinator's end-to-end tests."""
import pytest
import ray


@pytest.fixture(scope="module")
def local_ray():
    """One Ray instance for a test module: run_job joins an initialised Ray instead of starting its own.
    3 logical CPUs: a trainer plus up to two rollout workers (the scaling test) on this 2-core machine."""
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}})
    yield
    ray.shutdown()
