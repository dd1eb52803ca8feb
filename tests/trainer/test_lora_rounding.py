"""R3: a merged push with a bf16 base sends round_bf16(W + scale B A). The sum is taken once in fp32 and rounded
once (the nearest bf16 of the fp32 sum, not W + round(delta)), and still every element whose update is under half a
bf16 step of W comes back as W exactly: measured here for |W| ~ 0.02 and a young adapter (the numbers in
docs/lora.md, "Merged pushes in bf16"). An fp32 base keeps every update."""
from __future__ import annotations

import math

import torch

from gspo_ray.trainer.lora.peft_io import merged_weight

OUT, IN, RANK, SCALE = 256, 1024, 8, 2.0


def _weights(b_std: float, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    w = (0.02 * torch.randn(OUT, IN, generator=g)).to(dtype)
    a = (torch.rand(RANK, IN, generator=g) * 2 - 1) / math.sqrt(IN)  # PEFT-like A ~ U(+-1/sqrt(in))
    b = b_std * torch.randn(OUT, RANK, generator=g)
    return w, SCALE * b @ a  # delta in fp32, as ParallelLoRA.delta_weight gives it


def _half_ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """Half the bf16 spacing at |x| (8 significant bits: ulp = 2^(e - 8) for |x| in [2^(e-1), 2^e))."""
    _, e = torch.frexp(x.double().abs().clamp_min(2.0 ** -126))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e - 9)


def _lost_share(w, delta, merged) -> float:
    return ((merged == w) & (delta != 0)).double().mean().item()


def test_bf16_merge_rounds_once_to_the_nearest_and_loses_small_updates():
    stats = {}
    for b_std in (1e-4, 1e-3, 1e-2):
        w, delta = _weights(b_std)
        merged = merged_weight(w, delta)
        assert merged.dtype == torch.bfloat16
        fp32_sum = (w.float() + delta).double()  # the trainer's own W + delta, within ~1e-9 of the exact sum
        assert (fp32_sum - (w.double() + delta.double())).abs().max() < 1e-8
        # the nearest bf16 of it (a tie may go either way: round to even)
        assert ((merged.double() - fp32_sum).abs() <= _half_ulp_bf16(fp32_sum)).all()
        twice = w + delta.to(torch.bfloat16)  # rounding delta first, then the sum: what the merge must not do
        assert (twice != merged).any()
        lost = _lost_share(w, delta, merged)
        sent = (merged.double() - w.double()).flatten()
        stats[b_std] = (lost, torch.nn.functional.cosine_similarity(sent, delta.double().flatten(), dim=0).item())
    # young adapter (update rms ~1e-5): most updates are rounded away, the rest arrive as rounding noise
    assert stats[1e-4][0] > 0.8 and stats[1e-4][1] < 0.8
    # lost share falls as the adapter grows (update rms ~1e-4, ~1e-3)
    assert stats[1e-4][0] > stats[1e-3][0] > stats[1e-2][0] > 0
    assert stats[1e-2][1] > 0.99
    print("bf16 merged push, |W|~0.02: b_std -> (lost share, cos(sent, delta)):", stats)


def test_fp32_base_keeps_every_update():
    w, delta = _weights(1e-4, torch.float32)
    merged = merged_weight(w, delta)
    assert _lost_share(w, delta, merged) < 1e-3
    assert torch.allclose(merged - w, delta, atol=1e-8)
