"""Suite-wide settings. `dtype: auto` (the tiny recipe's) resolves to float32 on every host here, so the suite does
not change with the CPU it runs on (gspo_ray/models/native_bf16.py); subprocesses inherit it."""
import os

os.environ.setdefault("GSPO_RAY_AUTO_DTYPE", "float32")


import pytest  # noqa: E402

from gspo_ray.rollout.engine_env import bind_cores  # noqa: E402

_SESSION_AFFINITY = os.sched_getaffinity(0)


@pytest.fixture(autouse=True, scope="module")
def _cpu_affinity_of_the_session():
    """Every module starts and ends with the cores the session started with. An in-process engine pins every thread
    of its process (rollout/engine_env.bind_cores) and gives the cores back when it shuts down; a module that leaves
    one unclosed (a failed start, a test that keeps its engine) would otherwise leave the pytest process on one core,
    and a Ray started later in it (tests/coordinator's shared instance) hands that core to every actor, so a TP 2
    engine's two processes share it."""
    bind_cores(_SESSION_AFFINITY)
    yield
    bind_cores(_SESSION_AFFINITY)
