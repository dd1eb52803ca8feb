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

Guard. Only the plain `RotaryEmbedding` (rope, rope scaling folded into inv_freq) is handled; YaRN, mrope,
context parallelism and fused RoPE are refused. Other megatron-core versions get a warning: the test
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
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    check_version()
    inner = unwrap(model)
    rope = getattr(inner, "rotary_pos_emb", None)
    if getattr(inner, "position_embedding_type", None) != "rope" or type(rope) is not RotaryEmbedding:
        raise NotImplementedError(f"rope_positions handles plain RoPE only, not {type(rope).__name__} / "
                                  f"{getattr(inner, 'position_embedding_type', None)}")
    cfg = inner.config
    if cfg.apply_rope_fusion or cfg.multi_latent_attention:
        raise NotImplementedError("rope_positions: fused RoPE and multi-latent attention are not handled")
    if parallel_state.get_context_parallel_world_size() > 1:
        raise NotImplementedError("rope_positions: context parallelism would need a per-rank slice")
    freqs = rotary_freqs(rope, position_ids)

    def forward(*args, **kwargs):
        return freqs

    rope.forward = forward  # an instance attribute shadows the class's (lru-cached) forward
    try:
        yield freqs
    finally:
        del rope.forward
