"""megatron_rope_positions: the RoPE workaround is still needed, still correct, and attention honours a custom mask.

This test is the guard of a version-specific workaround (megatron-core 0.16.1 builds RoPE for positions 0..S-1
whatever `position_ids` say). It FAILS
  * when the workaround stops being needed: GPTModel's output starts depending on position_ids by itself;
  * when it stops being correct: with the override, output at shifted positions no longer equals transformers'
    at the same positions (and positions 0..S-1 no longer reproduce Megatron's own numbers).
It also checks that the layer spec's attention (model.SegmentAttention) follows the Segments record passed as the
mask: two sequences packed in one row as two segments after an empty prefix, positions restarting at 0, give each
sequence's own standalone output.
"""
from __future__ import annotations

import pytest
import torch

from _spawn import run_ranks

TOL = 1e-5


def _scenario(rank, world_size, ports, models):
    from transformers import AutoModelForCausalLM

    from gspo_ray.trainer.attention.segment_attention import Segments
    from gspo_ray.compat.megatron_rope_positions import check_version, rope_positions
    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed

    init_distributed(rank, world_size, "127.0.0.1", ports[0])
    out = {"version": check_version()}
    g = torch.Generator().manual_seed(0)
    for arch, hf_dir, vocab in models:
        model, _ = build_model(hf_dir)
        model.eval()
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        tokens = torch.randint(3, vocab, (2, 12), generator=g)
        pos = torch.arange(12).expand(2, -1)
        # a gap after 6 tokens (RoPE is relative: a uniform shift would change nothing)
        shifted = pos + (pos >= 6) * torch.tensor([[5], [17]])
        mask = Segments.plain([12, 12])
        with torch.no_grad():
            plain = model(tokens, pos, mask)
            ignored = model(tokens, shifted, mask)  # without the override position_ids do not reach RoPE
            with rope_positions(model, pos):
                same = model(tokens, pos, mask)
            with rope_positions(model, shifted):
                moved = model(tokens, shifted, mask)
            hf_moved = hf(tokens, position_ids=shifted).logits
            # packing: [a (7 tokens) | b (5 tokens)], b's positions restart at 0, two segments
            a, b = tokens[:1, :7], tokens[1:, :5]
            packed = torch.cat([a, b], dim=1)
            packed_pos = torch.cat([torch.arange(7), torch.arange(5)])[None]
            block = Segments(prefix=(0,), completions=((7, 5),))
            with rope_positions(model, packed_pos):
                packed_out = model(packed, packed_pos, block)
                causal_out = model(packed, packed_pos, Segments.plain([12]))  # the same row, one causal segment
            alone_a = model(a, torch.arange(7)[None], Segments.plain([7]))
            alone_b = model(b, torch.arange(5)[None], Segments.plain([5]))
        v = hf.config.vocab_size
        lsm = lambda x: torch.log_softmax(x[..., :v].float(), dim=-1)  # noqa: E731 (Megatron pads the vocabulary)
        out[arch] = {
            "ignored_diff": float((ignored - plain).abs().max()),
            "same_diff": float((same - plain).abs().max()),
            "moved_vs_hf": float((lsm(moved) - lsm(hf_moved)).abs().max()),
            "moved_vs_plain": float((lsm(moved) - lsm(plain)).abs().max()),
            "packed_a": float((packed_out[:, :7] - alone_a).abs().max()),
            "packed_b": float((packed_out[:, 7:] - alone_b).abs().max()),
            "causal_b": float((causal_out[:, 7:] - alone_b).abs().max()),
        }
    destroy_distributed()
    return out


@pytest.fixture(scope="module")
def res(tiny_qwen2_dir, tiny_llama_dir):
    models = [("qwen2", str(tiny_qwen2_dir), 23), ("llama", str(tiny_llama_dir), 22)]
    return run_ranks(_scenario, 1, (models,))[0]


def test_megatron_version_is_the_tested_one(res):
    from gspo_ray.compat.megatron_rope_positions import TESTED_VERSIONS

    assert res["version"] in TESTED_VERSIONS  # a new version: re-check the asserts below, then extend the list


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_workaround_is_needed_and_correct(res, arch):
    r = res[arch]
    # needed: GPTModel ignores position_ids for RoPE (if this fails, megatron honours them: drop the workaround)
    assert r["ignored_diff"] == 0.0
    # correct: positions 0..S-1 reproduce Megatron's own frequencies; shifted ones reproduce transformers'
    assert r["same_diff"] == 0.0
    assert r["moved_vs_hf"] <= TOL
    assert r["moved_vs_plain"] > 1e-3  # the shift matters, so the comparison above means something


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_attention_uses_the_passed_mask(res, arch):
    r = res[arch]
    assert r["packed_a"] <= TOL and r["packed_b"] <= TOL  # two segments + restarted positions = standalone
    assert r["causal_b"] > 1e-3  # as one causal segment b sees a: the record is what decides
