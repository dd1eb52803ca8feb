"""The shared-prefix forward in a whole job: 3 sync steps of the tiny recipe with trainer.shared_prefix on at
trainer.num_workers 2 (DP 2; the recipe's 16 x 8 rows and micro_batch_size 128 are the pack-starved shape of
deploy/kuberay/rayjob.yaml) and off at 1 end with the same weights (within 1e-4) and the same training metrics,
train/dp_imbalance <= 1.25 every step, and the token counters show the saving. Sharing alone and DP 4 are compared
rank by rank in tests/trainer/test_shared_prefix_parity.py."""
import pytest
import torch
from safetensors.torch import load_file

from gspo_ray.config import load_config
from gspo_ray.coordinator.job import run_job
from gspo_ray.coordinator.tracking import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]
RECIPE = "gspo_ray/recipes/tiny_moe.yaml"


def _run(tmp_path, shared: bool, workers: int = 1):
    # the package's Ray has 3 CPUs: one engine and up to 2 trainer ranks
    cfg = load_config(RECIPE, [f"logging.out_dir={tmp_path}", f"name=shared-{shared}", "logging.progress=false",
                               "logging.plot=false", "logging.tensorboard=false", "coordinator.steps=3",
                               "coordinator.mode=sync", "algorithm.eps=fixed", "coordinator.eval_every=0",
                               "coordinator.checkpoint_every=0", "data.num_eval=0", "rollout.verify_every=1",
                               f"trainer.shared_prefix={str(shared).lower()}", f"trainer.num_workers={workers}"])
    summary = run_job(cfg)
    rows = [r for r in read_metrics(summary.run_dir / "metrics.jsonl") if "train/loss" in r]
    return rows, load_file(str(summary.hf_dir / "model.safetensors"))


def test_three_steps_with_and_without_sharing_agree(tmp_path):
    """Group rows over 2 DP ranks against padded rows on 1: the same steps, and the ranks balanced."""
    shared_rows, shared_w = _run(tmp_path, True, workers=2)
    padded_rows, padded_w = _run(tmp_path, False)
    assert len(shared_rows) == len(padded_rows) == 3
    for a, b in zip(shared_rows, padded_rows):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]  # the same samples (the same policy)
        for key in ("train/loss", "train/ratio_mean", "train/n_tokens", "train/entropy", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        assert 1.0 <= a["train/dp_imbalance"] <= 1.25, a["train/dp_imbalance"]  # group rows dealt by cost
        assert b["train/dp_imbalance"] == 1.0
        assert a["train/row_tokens"] == b["train/row_tokens"] <= b["train/forward_tokens"]  # padding on top
        # every prompt once per group (16 groups of 8), counted over both ranks: fewer tokens than one row per sample
        assert a["train/forward_tokens"] < b["train/row_tokens"]
        assert a["sync/verify_max_abs_diff"] < 1e-4  # the engine agrees with the shared-prefix trainer
    assert set(shared_w) == set(padded_w)
    for name, w in padded_w.items():
        assert torch.allclose(shared_w[name], w, rtol=1e-4, atol=1e-6), name
