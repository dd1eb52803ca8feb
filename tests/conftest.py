"""Suite-wide settings. `dtype: auto` (the tiny recipe's) resolves to float32 on every host here, so the suite does
not change with the CPU it runs on (gspo_ray/models/native_bf16.py); subprocesses inherit it."""
import os

os.environ.setdefault("GSPO_RAY_AUTO_DTYPE", "float32")


import pytest  # noqa: E402

from gspo_ray.rollout.engine_env import bind_cores  # noqa: E402

_SESSION_AFFINITY = os.sched_getaffinity(0)


@pytest.fixture(autouse=True, scope="module")
def _cpu_affinity_of_the_session():
    """Every module must end on the cores the session started with. An in-process engine pins its process
    (rollout/engine_env.hold_process) and gives the cores back when the last engine shuts down or fails to start;
    a module that leaves one running would leave the pytest process on one core, and a Ray started later in it
    (tests/coordinator's shared instance) hands that core to every actor, so a TP 2 engine's two processes share
    it. Such a module fails here (the cores are put back for the modules after it)."""
    assert os.sched_getaffinity(0) == _SESSION_AFFINITY, "a module before this one left the process pinned"
    yield
    left = os.sched_getaffinity(0)
    if left != _SESSION_AFFINITY:
        bind_cores(_SESSION_AFFINITY)
        pytest.fail(f"this module left the process pinned to cores {sorted(left)} (the session's: "
                    f"{sorted(_SESSION_AFFINITY)}): an in-process engine was not shut down")
