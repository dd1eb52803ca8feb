"""Pipeline parallelism in a whole job: 3 sync steps of the tiny recipe (Qwen3-MoE, 2 layers) with the trainer at
trainer.pp 2 (2 ranks, one layer each) and at PP 1 end with the same weights (within 1e-4) and the same training
metrics, and every push from the PP 2 trainer passes the engine's probe (rollout.verify_every 1: the engine's
log-probs after the push against the trainer's). Rank by rank equality is tests/trainer/test_pipeline.py's."""
import pytest
import torch
from safetensors.torch import load_file

from gspo_ray.config import load_config
from gspo_ray.coordinator.job import run_job
from gspo_ray.coordinator.tracking import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]
RECIPE = "gspo_ray/recipes/tiny_moe.yaml"


def _run(tmp_path, pp: int):
    cfg = load_config(RECIPE, [f"logging.out_dir={tmp_path}", f"name=pp-{pp}", "logging.progress=false",
                               "logging.plot=false", "logging.tensorboard=false", "coordinator.steps=3",
                               "coordinator.mode=sync", "algorithm.eps=fixed", "coordinator.eval_every=0",
                               "coordinator.checkpoint_every=0", "data.num_eval=0", "rollout.verify_every=1",
                               f"trainer.num_workers={pp}", f"trainer.pp={pp}"])
    summary = run_job(cfg)
    rows = [r for r in read_metrics(summary.run_dir / "metrics.jsonl") if "train/loss" in r]
    return rows, load_file(str(summary.hf_dir / "model.safetensors"))


def test_three_steps_at_pp2_and_pp1_agree(tmp_path):
    pp2_rows, pp2_w = _run(tmp_path, 2)
    pp1_rows, pp1_w = _run(tmp_path, 1)
    assert len(pp2_rows) == len(pp1_rows) == 3
    assert "moe/router_churn" in pp2_rows[0]  # router churn measured at step 1 (trainer.router_churn_every)
    for a, b in zip(pp2_rows, pp1_rows):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]  # the same samples (the same policy)
        for key in ("train/loss", "train/ratio_mean", "train/n_tokens", "train/entropy", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        for key in ("moe/router_churn", "moe/drift_churn"):  # routing watched per stage, joined (when measured)
            assert (key in a) == (key in b) and a.get(key, 0.0) == pytest.approx(b.get(key, 0.0), abs=1e-6), key
        assert a["sync/verify_max_abs_diff"] < 1e-4  # the engine agrees with the PP 2 trainer after its push
    assert set(pp2_w) == set(pp1_w)
    for name, w in pp1_w.items():
        assert torch.allclose(pp2_w[name], w, rtol=1e-4, atol=1e-6), name
