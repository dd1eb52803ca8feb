"""The shared-prefix forward in a whole job: 3 sync steps of the tiny recipe with trainer.shared_prefix on and off
end with the same weights (within 1e-4) and the same training metrics, and the token counters show the saving.
At trainer.num_workers 2 (DP; the tiny recipe's 16 x 8 rows and micro_batch_size 128 are the pack-starved shape of
deploy/kuberay/rayjob.yaml) the first steps give the same loss and reward as 1 rank, balanced. 4 workers pass too
(measured: 63 s against 38 s for 2); DP 4 is covered rank by rank in tests/trainer/test_shared_prefix_parity.py."""
import pytest
import torch
from safetensors.torch import load_file

from gspo_ray.config import load_config
from gspo_ray.coordinator.job import run_job
from gspo_ray.coordinator.tracking import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]
RECIPE = "gspo_ray/recipes/tiny_moe.yaml"


def _run(tmp_path, shared: bool, workers: int = 1, steps: int = 3):
    cfg = load_config(RECIPE, [f"logging.out_dir={tmp_path}", f"name=shared-{shared}-{workers}",
                               "logging.progress=false", "logging.plot=false", "logging.tensorboard=false",
                               f"coordinator.steps={steps}", "coordinator.mode=sync", "algorithm.eps=fixed",
                               "coordinator.eval_every=0", "coordinator.checkpoint_every=0", "data.num_eval=0",
                               "rollout.verify_every=1", f"trainer.shared_prefix={str(shared).lower()}",
                               # the package's Ray has 3 CPUs: one engine and up to 4 ranks at half a CPU
                               f"trainer.num_workers={workers}", f"trainer.num_cpus_per_worker={2 / workers}"])
    summary = run_job(cfg)
    rows = [r for r in read_metrics(summary.run_dir / "metrics.jsonl") if "train/loss" in r]
    return rows, load_file(str(summary.hf_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("shared"), True)


@pytest.mark.parametrize("workers", [2])
def test_dp_ranks_train_the_same_steps_balanced(tmp_path, shared_run, workers):
    one_rank, _ = shared_run
    rows, _ = _run(tmp_path, True, workers, steps=2)
    assert len(rows) == 2
    for a, b in zip(rows, one_rank):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]  # the same samples (the same policy)
        for key in ("train/loss", "train/pg_loss", "train/n_tokens", "train/entropy", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        assert 1.0 <= a["train/dp_imbalance"] <= 1.25, a["train/dp_imbalance"]
        assert b["train/dp_imbalance"] == 1.0
        # the ranks' tokens add up to about one rank's (a dummy or a prefix copy more at most)
        assert b["train/forward_tokens"] <= a["train/forward_tokens"] <= 1.25 * b["train/forward_tokens"]


def test_three_steps_with_and_without_sharing_agree(tmp_path, shared_run):
    shared_rows, shared_w = shared_run
    padded_rows, padded_w = _run(tmp_path, False)
    assert len(shared_rows) == len(padded_rows) == 3
    for a, b in zip(shared_rows, padded_rows):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]  # the same samples (the same policy)
        for key in ("train/loss", "train/ratio_mean", "train/n_tokens", "train/entropy", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        assert a["train/row_tokens"] == b["train/row_tokens"] <= b["train/forward_tokens"]  # padding on top
        # every prompt once per group (16 groups of 8): fewer tokens than one row per sample
        assert a["train/forward_tokens"] < b["train/row_tokens"]
        assert a["sync/verify_max_abs_diff"] < 1e-4  # the engine agrees with the shared-prefix trainer
    assert set(shared_w) == set(padded_w)
    for name, w in padded_w.items():
        assert torch.allclose(shared_w[name], w, rtol=1e-4, atol=1e-6), name
