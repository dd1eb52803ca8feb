"""Megatron per-token log-probs (HF weights loaded by bridge.py) equal transformers', in every layout.

One pair of spawned processes: rank 0 first runs the 1-process checks in a world of its own, then both ranks walk
through the 2-rank layouts in turn (DP=2, TP=2+SP, EP=2 with both token dispatchers, TP=2+SP with EP=2), rebuilding
Megatron's groups between them. fp32 throughout; tolerance 1e-5 on log-probs and entropies (measured: <= 1e-6).
"""
from __future__ import annotations

import pytest
import torch

from _spawn import run_ranks

TOL = 1e-5
# (layout, tp, ep, dispatcher, archs); EP needs experts, so the dense model sits those out
LAYOUTS = [
    ("dp2", 1, 1, "alltoall", ("qwen2", "qwen3_moe")),
    ("tp2_sp", 2, 1, "alltoall", ("qwen2", "qwen3_moe", "llama")),
    ("ep2_alltoall", 1, 2, "alltoall", ("qwen3_moe",)),
    ("ep2_allgather", 1, 2, "allgather", ("qwen3_moe",)),
    ("tp2_sp_ep2", 2, 2, "alltoall", ("qwen3_moe",)),
]
CASES = [(layout, arch) for layout, _, _, _, archs in LAYOUTS for arch in archs]


def _rows(tp: int, rank: int, world: int) -> slice:
    """TP ranks share one batch; data-parallel ranks take alternate rows."""
    return slice(None) if tp > 1 else slice(rank, None, world)


def score_mask(tokens):
    """A fixed pattern of scored tokens (a stand-in for a loss mask: some rows score few tokens)."""
    return (torch.arange(tokens.numel()).reshape(tokens.shape) % 3) != 0


def _embedding_grad(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return model.embedding.word_embeddings.weight.grad.detach().clone()  # this rank's vocabulary rows under TP


def _logprobs(model, tokens, lengths):
    from gspo_ray.trainer.logprobs import forward_logprobs

    logp, entropy = forward_logprobs(model, tokens, lengths, with_entropy=True)
    grad = _embedding_grad(model, logp.sum())  # differentiable end to end: gradients reach the embedding
    mask = score_mask(tokens)
    # scoring only masked tokens (the output layer skips the others) gives the same values and gradient
    masked, masked_ent = forward_logprobs(model, tokens, lengths, with_entropy=True, score_mask=mask)
    masked_grad = _embedding_grad(model, masked.sum())
    full = forward_logprobs(model, tokens, lengths)
    full_grad = _embedding_grad(model, (full * mask).sum())
    return {"logp": logp.detach(), "entropy": entropy.detach(), "grad_sq": float(grad.double().square().sum()),
            "plain": forward_logprobs(model, tokens, lengths).detach(),
            "masked_diff": float((masked.detach() - full.detach() * mask).abs().max()),
            "masked_ent_diff": float((masked_ent - entropy.detach() * mask).abs().max()),
            "masked_grad_diff": float((masked_grad - full_grad).abs().max()),
            "masked_grad_sq": float(masked_grad.double().square().sum())}


def _single(rdzv: str, models):
    """1-process checks (a world of one)."""
    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed

    init_distributed(0, 1, "", 0, init_method=f"file://{rdzv}/single")
    out = {}
    for arch, (hf_dir, tokens, lengths) in models.items():
        model, spec = build_model(hf_dir)
        out[arch] = _logprobs(model, tokens, lengths)
        out[arch]["lengths_none"] = _no_lengths(model, tokens)
        bf16, _ = build_model(hf_dir, dtype=torch.bfloat16)
        out[arch]["bf16"] = _no_lengths(bf16, tokens) * (out[arch]["logp"] != 0)
        out[arch]["bf16_dtypes"] = sorted({str(p.dtype) for p in bf16.parameters()})
    destroy_distributed()
    destroy_distributed()  # a second teardown is harmless
    return out


def _no_lengths(model, tokens):
    from gspo_ray.trainer.logprobs import forward_logprobs

    with torch.no_grad():
        return forward_logprobs(model, tokens).detach()


def _scenario(rank, world_size, ports, models, rdzv):
    """Rendezvous through files in `rdzv` (no TCP port to race for while other jobs share the machine)."""
    from megatron.core import parallel_state

    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed

    out = {"single": _single(rdzv, models) if rank == 0 else None}
    for layout, tp, ep, dispatcher, archs in LAYOUTS:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()  # keep the process group, rebuild TP/EP groups
        init_distributed(rank, world_size, "", 0, tp=tp, ep=ep, init_method=f"file://{rdzv}/pair")
        for arch in archs:
            hf_dir, tokens, lengths = models[arch]
            model, spec = build_model(hf_dir, moe_dispatcher=dispatcher)
            rows = _rows(tp, rank, world_size)
            out[(layout, arch)] = _logprobs(model, tokens[rows], lengths[rows])
            out[(layout, arch)]["spec"] = (spec.tp, spec.ep, spec.sequence_parallel, spec.padded_vocab_size)
    destroy_distributed()
    return out


@pytest.fixture(scope="module")
def inputs(tiny_models):
    return {arch: (d, tokens, lengths) for arch, (d, tokens, lengths, _, _) in tiny_models.items()}


@pytest.fixture(scope="module")
def runs(inputs, tmp_path_factory):
    return run_ranks(_scenario, 2, (inputs, str(tmp_path_factory.mktemp("rdzv"))), n_ports=0)


@pytest.fixture(scope="module")
def single(runs):
    return runs[0]["single"]


@pytest.fixture(scope="module")
def layouts(runs):
    return runs


def _assert_close(got: dict, ref_logp, ref_entropy, what: str):
    diff_logp = (got["logp"] - ref_logp).abs().max().item()
    diff_ent = (got["entropy"] - ref_entropy).abs().max().item()
    assert diff_logp <= TOL, f"{what}: log-prob max diff {diff_logp:.2e}"
    assert diff_ent <= TOL, f"{what}: entropy max diff {diff_ent:.2e}"
    assert torch.equal(got["plain"], got["logp"]), f"{what}: with_entropy changed the log-probs"
    assert got["grad_sq"] > 0, f"{what}: no gradient reached the embedding"
    assert got["masked_diff"] <= 1e-6 and got["masked_ent_diff"] <= 1e-6, f"{what}: score_mask changed values"
    assert got["masked_grad_sq"] > 0 and got["masked_grad_diff"] <= 1e-6, f"{what}: score_mask changed the gradient"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe", "llama"])
def test_single_process_matches_transformers(single, tiny_models, arch):
    _, tokens, lengths, ref_logp, ref_entropy = tiny_models[arch]
    got = single[arch]
    _assert_close(got, ref_logp, ref_entropy, f"1 process {arch}")
    # padding and position 0 are exactly 0; without lengths every position after 0 is scored
    pos = torch.arange(tokens.shape[1])[None]
    assert torch.all(got["logp"][(pos == 0) | (pos >= lengths[:, None])] == 0)
    full = got["lengths_none"]
    assert torch.all(full[:, 1:] < 0) and torch.equal(full[:, 0], torch.zeros(len(tokens)))
    valid = (pos >= 1) & (pos < lengths[:, None])
    assert torch.allclose(full[valid], got["logp"][valid], atol=1e-6)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe", "llama"])
def test_bf16_model_is_bf16_and_close(single, tiny_models, arch):
    """bf16 weights (norms included, as in HF) give log-probs near the fp32 reference (measured max ~3e-3)."""
    assert single[arch]["bf16_dtypes"] == ["torch.bfloat16"]
    assert (single[arch]["bf16"] - tiny_models[arch][3]).abs().max() < 0.02


@pytest.mark.parametrize("layout,arch", CASES)
def test_two_rank_layout_matches_transformers(layouts, tiny_models, layout, arch):
    _, _, _, ref_logp, ref_entropy = tiny_models[arch]
    tp = next(t for name, t, *_ in LAYOUTS if name == layout)
    for rank, res in enumerate(layouts):
        rows = _rows(tp, rank, len(layouts))
        _assert_close(res[(layout, arch)], ref_logp[rows], ref_entropy[rows], f"{layout} rank {rank} {arch}")
    if tp > 1:  # same batch on both ranks: the two vocabulary shards of the gradient make up the 1-process one
        grad_sq = sum(res[(layout, arch)]["grad_sq"] for res in layouts)
        assert grad_sq == pytest.approx(layouts[0]["single"][arch]["grad_sq"], rel=1e-5)
    spec_tp, spec_ep, sp, padded_vocab = layouts[0][(layout, arch)]["spec"]
    assert spec_tp == tp and sp == (tp > 1)
    if arch == "qwen2" and tp == 2:
        assert padded_vocab == 24  # the odd vocabulary really was padded, and the padding was hidden
