"""Shared fixtures for the coordinator's end-to-end tests."""
import pytest
import ray


@pytest.fixture(scope="package")
def _ray_of_the_package():
    """Ends the shared Ray instance (if one is up) once the package's last test has run."""
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def local_ray(_ray_of_the_package):
    """One Ray instance shared by this package's job tests: run_job joins an initialised Ray instead of starting
    its own. Started by the first module that asks for it and kept for the next ones (a start costs ~7 s and
    ~10 CPU-seconds here); a module that needs other settings shuts it down and starts its own, and the next
    module that asks starts a fresh one. 5 logical CPUs on this 2-core machine: a trainer plus two TP 2 rollout
    engines of 2 CPUs each (test_live_scaling_job.py; its own instance cost a Ray start there and another in the
    next module). Each job stops its own actors, which the job-name test checks (every CPU free)."""
    if not ray.is_initialized():
        ray.init(num_cpus=5, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
                                           "VLLM_LOGGING_LEVEL": "WARNING"}})
    yield
