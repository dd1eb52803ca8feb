"""trainer.head_dtype through Megatron's own output layer (the path a vocabulary split runs; here one rank with the
fused head switched off): in a bf16 model the fp32 head gives the fused fp32 head's log-probs within fp32
rounding, far from the model-dtype head's, and its gradients reach the bf16 parameters in bf16."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from gspo_ray.models.tiny import ensure_tiny_model
from tests.tolerance import rounding_bound

sys.path.append(str(Path(__file__).resolve().parent))  # `_spawn`
from _spawn import run_ranks  # noqa: E402


def _scenario(rank, world_size, ports, model_dir):
    from gspo_ray.trainer import logprobs
    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed
    from gspo_ray.trainer.attention.segment_attention import Segments

    init_distributed(0, 1, "127.0.0.1", ports[0])
    model, _ = build_model(model_dir, dtype=torch.bfloat16)
    tokens = torch.randint(3, 20, (3, 12), generator=torch.Generator().manual_seed(0))
    fused = logprobs._fused_head

    def score(head_dtype, megatron_layer, grad=False):
        logprobs._fused_head = (lambda inner: False) if megatron_layer else fused
        try:
            with torch.set_grad_enabled(grad):
                return logprobs.forward_logprobs(model, tokens, head_dtype=head_dtype)
        finally:
            logprobs._fused_head = fused

    with torch.no_grad():  # the logits' magnitude |h| . |W| per scored position, for the rounding bound
        weights: list = []
        b_idx, t_idx = torch.ones_like(tokens, dtype=torch.bool)[:, 1:].nonzero(as_tuple=True)
        with logprobs.output_hidden(model, t_idx, b_idx, weights):
            hidden = model(tokens, torch.arange(12).expand(3, -1), Segments.plain([12] * 3))[0]
        magnitude = (hidden.float().abs() @ weights[0].float().abs().t()).max(-1).values
    out = {"fused32": score("float32", False), "megatron32": score("float32", True),
           "model": score("model", True), "magnitude": magnitude, "hidden_size": hidden.shape[-1]}
    logp = score("float32", True, grad=True)
    logp.sum().backward()
    out["grad_dtypes"] = {p.grad.dtype for p in model.parameters() if p.grad is not None}
    destroy_distributed()
    return out


def test_fp32_head_through_megatrons_output_layer(tmp_path):
    # initializer_range 0.3: peaked logits (|z| ~ 10), whose bf16 rounding is far above fp32's
    model_dir = ensure_tiny_model("qwen3_moe", tmp_path / "tiny", seed=0, init_std=0.3)
    out = run_ranks(_scenario, 1, (str(model_dir),))[0]
    fused32, megatron32, model = out["fused32"][:, 1:], out["megatron32"][:, 1:], out["model"][:, 1:]
    # two fp32 evaluations of an H-term logit and a V-term log-softmax (V = 22 here)
    bound = (2 * rounding_bound(out["hidden_size"], out["magnitude"]) + rounding_bound(22, 1.0)).view_as(fused32)
    assert ((megatron32 - fused32).abs() <= bound).all()
    assert (model - fused32).abs().max() > 10 * bound.max()
    assert out["grad_dtypes"] == {torch.bfloat16}
