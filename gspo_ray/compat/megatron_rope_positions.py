"""RoPE at given per-token positions for megatron-core's GPTModel (a version-guarded workaround).

    with rope_positions(model, position_ids):          # position_ids [B, S] long
        out = model(tokens, position_ids, attention_mask)

Why. In megatron-core 0.16.1, `GPTModel._preprocess` (models/gpt/gpt_model.py) builds the rotary frequencies as
`self.rotary_pos_emb(rotary_seq_len)`, i.e. for positions 0..S-1 of every row; `position_ids` reach only the
learned position embedding (unused with rope) and mrope. A layout whose positions do not run 0..S-1 (a shared
prefix followed by segments that each continue from it) needs its own frequencies.

What. Inside the block the model's `RotaryEmbedding.forward` (the lru-cached method GPTModel calls) returns

    freqs[s, b, 0, :] = cat(p * inv_freq, p * inv_freq)      p = position_ids[b, s] (/ seq_len_interpolation)

shape [S, B, 1, D], which `apply_rotary_pos_emb` broadcasts over heads of query/key [S, B, H, D] exactly as it
does Megatron's own [S, 1, 1, D] (cos/sin of the same fp32 products, so positions 0..S-1 give bit-equal output).
Under sequence parallelism attention runs on the gathered sequence, so the full [S, B] positions are right.
Under context parallelism (trainer.cp) the model holds this rank's columns of each row only (zig-zag chunks,
trainer/attention/context_split.py), and the caller passes their positions, `position_ids[:, columns]`:
frequencies are per token, so any set of columns gets its own; Megatron's own CP slice of the rotary table
(get_pos_emb_on_this_cp_rank, in RotaryEmbedding.forward) is bypassed with the forward it lives in.

Multi-latent attention. GPTModel builds no rotary embedding for MLA: each MLASelfAttention layer computes its own
in `get_query_key_value_tensors`, `self.rotary_pos_emb(rotary_seq_len)` (a `RotaryEmbedding` of
qk_pos_emb_head_dim, or a `YarnRotaryEmbedding` that returns (freqs, mscale)), slices it to the query's length
and rotates q's and k's rope parts with it. Within the block each such layer's embedding returns the rows of its own
table `get_emb(max(position) + 1)` at `position_ids`, laid out [S, B, 1, D] (with YaRN's mscale as before): the
same fp32 numbers Megatron computes for those positions (each row of the outer product is one multiply per
element), so positions 0..S-1 give bit-equal output again, and YaRN's frequency ramp and mscale are Megatron's own.

Guard. Plain `RotaryEmbedding` (rope, rope scaling folded into inv_freq) in the model, and `RotaryEmbedding` /
`YarnRotaryEmbedding` inside multi-latent attention layers, are handled; YaRN outside MLA, mrope, context
parallelism with multi-latent attention and fused RoPE are refused. Other megatron-core versions get a warning: the test
tests/compat/test_megatron_rope_positions.py fails both when the workaround stops being needed (GPTModel honours
position_ids) and when it stops being correct (it no longer reproduces transformers at shifted positions).
"""
from __future__ import annotations

import contextlib
import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

TESTED_VERSIONS = ("0.16.1",)
_checked: list[str] = []


def check_version() -> str:
    """megatron-core's version; warns once when it is not one this workaround was tested with."""
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    if version not in TESTED_VERSIONS and version not in _checked:
        log.warning("megatron_rope_positions: tested with megatron-core %s, found %s; run "
                    "tests/compat/test_megatron_rope_positions.py", ", ".join(TESTED_VERSIONS), version)
    if version not in _checked:
        _checked.append(version)
    return version


def unwrap(model):
    """DDP / Float16Module wrappers -> the GPTModel inside."""
    while not hasattr(model, "rotary_pos_emb") and hasattr(model, "module"):
        model = model.module
    return model


def rotary_freqs(rope, position_ids: Tensor) -> Tensor:
    """[B, S] positions -> [S, B, 1, D] fp32 rotary angles, laid out like RotaryEmbedding.get_emb's."""
    inv_freq = rope.inv_freq.to(position_ids.device)
    seq = position_ids.to(inv_freq.dtype)
    if rope.seq_len_interpolation_factor is not None:
        seq = seq * (1 / rope.seq_len_interpolation_factor)
    freqs = seq[..., None] * inv_freq  # [B, S, D/2]; == torch.outer(seq, inv_freq) row by row
    if not rope.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs, freqs), dim=-1).reshape(*freqs.shape[:-1], -1)
    return emb.transpose(0, 1)[:, :, None, :].contiguous()


@contextlib.contextmanager
def rope_positions(model, position_ids: Tensor):
    """Within the block, `model`'s rotary embedding gives the frequencies of `position_ids` [B, S]."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    check_version()
    inner = unwrap(model)
    if getattr(getattr(inner, "config", None), "multi_latent_attention", False):
        with mla_rope_positions(model, position_ids) as freqs:
            yield freqs
        return
    rope = getattr(inner, "rotary_pos_emb", None)
    if getattr(inner, "position_embedding_type", None) != "rope" or type(rope) is not RotaryEmbedding:
        raise NotImplementedError(f"rope_positions handles plain RoPE only, not {type(rope).__name__} / "
                                  f"{getattr(inner, 'position_embedding_type', None)}")
    cfg = inner.config
    if cfg.apply_rope_fusion or cfg.multi_latent_attention:
        raise NotImplementedError("rope_positions: fused RoPE and multi-latent attention are not handled")
    freqs = rotary_freqs(rope, position_ids)  # under CP: this rank's columns' positions, as the caller passes them

    def forward(*args, **kwargs):
        return freqs

    rope.forward = forward  # an instance attribute shadows the class's (lru-cached) forward
    try:
        yield freqs
    finally:
        del rope.forward


def mla_rotary_embeddings(model) -> list:
    """The rotary embeddings of `model`'s multi-latent attention layers (one per layer), in module order."""
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    return [m.rotary_pos_emb for m in model.modules() if isinstance(m, MultiLatentAttention)]


def table_freqs(rope, position_ids: Tensor):
    """[B, S] positions -> ([S, B, 1, D] fp32 angles, mscale): rows of the embedding's own table (RotaryEmbedding:
    mscale 1.0; YarnRotaryEmbedding: its concentration factor)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    rows = int(position_ids.max()) + 1 if position_ids.numel() else 1
    table, mscale = rope.get_emb(rows) if isinstance(rope, YarnRotaryEmbedding) else (rope.get_emb(rows), 1.0)
    freqs = table[:, 0, 0, :][position_ids.to(table.device)]  # [B, S, D]
    return freqs.transpose(0, 1)[:, :, None, :].contiguous(), mscale


@contextlib.contextmanager
def mla_rope_positions(model, position_ids: Tensor):
    """Within the block, every multi-latent attention layer of `model` (a GPTModel or any module holding such
    layers) rotates by `position_ids` [B, S]; yields the [S, B, 1, D] angles of the first layer."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    check_version()
    ropes = mla_rotary_embeddings(model)
    if not ropes:
        raise NotImplementedError("mla_rope_positions: no multi-latent attention layer in the model")
    for rope in ropes:
        if type(rope) not in (RotaryEmbedding, YarnRotaryEmbedding):
            raise NotImplementedError(f"mla_rope_positions handles rope and YaRN, not {type(rope).__name__}")
    config = getattr(unwrap(model), "config", None)
    if config is not None and config.apply_rope_fusion:
        raise NotImplementedError("mla_rope_positions: fused MLA RoPE (apply_rope_fusion) is not handled")
    if parallel_state.get_context_parallel_world_size() > 1:  # refused by the config and SegmentAttention too
        raise NotImplementedError("mla_rope_positions: context parallelism with multi-latent attention is not built")
    first = None
    for rope in ropes:  # each layer's own table (a few kB: rows up to the largest position)
        freqs, mscale = table_freqs(rope, position_ids)
        first = freqs if first is None else first
        yarn = isinstance(rope, YarnRotaryEmbedding)

        def forward(*args, _freqs=freqs, _mscale=mscale, _yarn=yarn, **kwargs):
            return (_freqs, _mscale) if _yarn else _freqs

        rope.forward = forward  # an instance attribute shadows the class's (lru-cached) forward
    try:
        yield first
    finally:
        for rope in ropes:
            del rope.forward
