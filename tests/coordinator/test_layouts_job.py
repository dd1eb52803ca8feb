"""Trainer layouts in a whole job, each against one baseline: 3 sync steps of the tiny recipe (Qwen3-MoE, 2 layers)
on one trainer rank with padded rows (trainer.shared_prefix off). The same steps end with the same weights (within
1e-4) and the same training metrics

- with trainer.shared_prefix on at trainer.num_workers 2 (DP 2; the recipe's 16 x 8 rows and micro_batch_size 128 are
  the pack-starved shape of deploy/kuberay/rayjob.yaml), train/dp_imbalance <= 1.25 every step, and the token
  counters show the saving;
- at trainer.pp 2 (2 ranks, one layer each; group rows, the default), router churn measured over both stages.

Every push is probe-checked (rollout.verify_every 1: the engine's log-probs after the push against the trainer's).
Rank by rank equality is tests/trainer/test_shared_prefix_parity.py's (sharing, DP 4) and test_pipeline.py's (PP)."""
import pytest
import torch
from safetensors.torch import load_file

from gspo_ray.config import load_config
from gspo_ray.coordinator.job import run_job
from gspo_ray.coordinator.tracking import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]
RECIPE = "gspo_ray/recipes/tiny_moe.yaml"
SAME = ("train/loss", "train/ratio_mean", "train/n_tokens", "train/entropy", "train/grad_norm")


def _run(out_dir, name: str, *overrides: str):
    # the package's Ray has 3 CPUs: one engine and up to 2 trainer ranks
    cfg = load_config(RECIPE, [f"logging.out_dir={out_dir}", f"name={name}", "logging.progress=false",
                               "logging.plot=false", "logging.tensorboard=false", "coordinator.steps=3",
                               "coordinator.mode=sync", "algorithm.eps=fixed", "coordinator.eval_every=0",
                               "coordinator.checkpoint_every=0", "data.num_eval=0", "rollout.verify_every=1",
                               *overrides])
    summary = run_job(cfg)
    rows = [r for r in read_metrics(summary.run_dir / "metrics.jsonl") if "train/loss" in r]
    return rows, load_file(str(summary.hf_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """The baseline: padded rows on one rank."""
    return _run(tmp_path_factory.mktemp("padded"), "padded", "trainer.shared_prefix=false", "trainer.num_workers=1")


def _assert_same_training(rows, weights, base_rows, base_weights):
    assert len(rows) == len(base_rows) == 3
    for a, b in zip(rows, base_rows):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]  # the same samples (the same policy)
        for key in SAME:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        assert a["sync/verify_max_abs_diff"] < 1e-4  # the engine agrees with this layout's trainer after its push
    assert set(weights) == set(base_weights)
    for name, w in base_weights.items():
        assert torch.allclose(weights[name], w, rtol=1e-4, atol=1e-6), name


def test_group_rows_over_two_dp_ranks(tmp_path, padded):
    """Group rows over 2 DP ranks against padded rows on 1: the same steps, and the ranks balanced."""
    rows, weights = _run(tmp_path, "shared-dp2", "trainer.shared_prefix=true", "trainer.num_workers=2")
    base_rows, base_weights = padded
    _assert_same_training(rows, weights, base_rows, base_weights)
    for a, b in zip(rows, base_rows):
        assert 1.0 <= a["train/dp_imbalance"] <= 1.25, a["train/dp_imbalance"]  # group rows dealt by cost
        assert b["train/dp_imbalance"] == 1.0
        assert a["train/row_tokens"] == b["train/row_tokens"] <= b["train/forward_tokens"]  # padding on top
        # every prompt once per group (16 groups of 8), counted over both ranks: fewer tokens than one row per sample
        assert a["train/forward_tokens"] < b["train/row_tokens"]


def test_two_pipeline_stages(tmp_path, padded):
    """PP 2 (group rows) against the padded PP 1 baseline. Routing is watched per stage and joined: router churn is
    measured at step 1 (trainer.router_churn_every); its equality with PP 1 is test_pipeline.py's (the same rows:
    here the baseline counts each prompt once per sample, group rows once per group)."""
    rows, weights = _run(tmp_path, "pp-2", "trainer.num_workers=2", "trainer.pp=2")
    _assert_same_training(rows, weights, *padded)
    assert "moe/router_churn" in rows[0]  # measured over both stages and joined (its value: test_pipeline.py)
