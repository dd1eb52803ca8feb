"""Attention by segment: the core attention of our layer spec, whose memory and work grow with the segments of a
row, never with the square of its width.

    segs = Segments.plain(lengths)                        # padded rows: each row one causal segment
    segs = Segments(prefix=(P,), completions=((c_1, .., c_G),))   # one group row [prefix | c_1 | .. | c_G]
    segs = Segments.plain(lengths, packed=True)           # one packed row [s_1 | s_2 | ..]: no padding between
    model(tokens, position_ids, segs)                     # the record travels as GPTModel's `attention_mask`

A row of width S (the micro-batch's sequence dimension) holds a prefix of P tokens, then completion segments of
c_1 .. c_G tokens, then padding. A query of the prefix attends to the prefix causally; a query of completion j
attends to [prefix ; completion j] with causality aligned bottom-right (its i-th query sees the whole prefix and
completion tokens 0..i), nothing of the other completions; a padding query attends to nothing and outputs 0 (so
no NaN reaches a weight gradient through 0 x NaN). A padded row of n tokens is a prefix of n and no completion.

Packed rows (`packed=True`). The record's units (a prefix and its completions each: one sequence, or one group row)
then lie one after another along ONE row of the micro-batch, [unit_1 | unit_2 | .. | tail padding]: each unit
attends within itself exactly as a row of its own would (attention never crosses a unit boundary), so no padding
is forwarded between sequences of different lengths, only a short tail (sequence parallelism needs the row's width
to be a multiple of TP). This is the layout of Megatron's `PackedSeqParams` (THD, `cu_seqlens` per sequence) with
TE, expressed by this record instead; RoPE positions restart at 0 in each unit (the caller's position ids,
compat/megatron_rope_positions.py).

Per segment this is one `torch.nn.functional.scaled_dot_product_attention` call: the prefix with is_causal, a
completion with `torch.nn.attention.bias.causal_lower_right(c, P + c)` on keys and values [prefix ; completion],
GQA through `enable_gqa` (no repeated K/V where the fused kernel takes GQA; see below). On CPU (torch 2.13) both
reach the flash kernel for CPU (checked: grad_fn ScaledDotProductFlashAttentionForCpuBackward0), which works block by
block: no score matrix is held; the lower-right mask is one [c, P + c] bool tensor per call (built here on CPU, as
causal_lower_right materialises it there; the CausalBias object on CUDA). On CUDA the same calls run on torch's flash /
memory-efficient kernels (the lower-right variant has native support there). Only flash takes GQA there, and flash
refuses fp32: so where flash will not take a GQA call (fp32, or a GPU before sm80), K/V heads are repeated per query
head first (`kernel_kv`, exactly what enable_gqa computes) and the memory-efficient kernel runs it; without that
torch would fall to its math kernel, with a materialised [c, P + c] mask and score matrix per head. Which kernel
each call gets on a GPU is read from torch's dispatch (torch/nn/attention/bias.py, sdp_utils), not run here.

Memory. A completion's keys and values [prefix ; completion] are a gathered copy; kept for the backward of every
segment and layer they would hold the prefix once per completion (G x P keys a group row and layer). So a
completion call with a prefix runs under activation checkpointing (torch.utils.checkpoint, non-reentrant): the
backward gathers and attends again (one more attention forward of that segment), and what stays between forward
and backward is the call's output only. The prefix call and a plain row gather nothing and are not recomputed.

What the kernel computes per unit, counted as query-key pairs (`Segments.pairs`, the planner's attention term):

    P (P + 1) / 2  +  sum_j c_j (P + (c_j + 1) / 2)

(the causal triangle of the prefix, then each completion against the prefix and its own triangle); versus
W (W + 1) / 2 for one causal row of width W = P + sum_j c_j, and W^2 for the dense [W, W] mask this replaces.
Padding computes no pair, so a packed row costs the sum over its units, as separate rows would.

Torch only (the planner and the scale model import Segments without Megatron); model.SegmentAttention is the
Megatron core-attention module that calls attend_rows. The record travels as the `attention_mask` argument, which
GPTModel hands to every layer's core attention and nothing else reads on the local spec. Megatron's
`PackedSeqParams` is not used: GPTModel sizes RoPE from its max_seqlen fields and attention squeezes THD tensors,
neither of which this layout wants. Not covered (refused at construction, and by the preflight through
model_spec): attention dropout, context parallelism with multi-latent attention, and with sliding windows or
attention sinks. Sliding windows and learned sinks (gpt-oss) are windows.py's: `attend_rows(..., window=,
sinks=)`. Context parallelism (trainer.cp) splits each row's columns over the CP ranks: context_split.attend_columns computes the same numbers for a rank's columns against the gathered keys.

Multi-latent attention (DeepSeek-V3, Kimi-K2: Megatron's MLASelfAttention with this module as its core attention)
reaches attend_rows as plain multi-head attention over the up-projected q / k (qk_nope_head_dim + qk_rope_head_dim
wide) and v (v_head_dim): the segments are the same, V is padded to the q / k width for the fused kernel (see
attend_rows), and the rotary positions of group and packed rows are set per layer by
compat/megatron_rope_positions.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from gspo_ray.trainer.attention.windows import attend_windowed_unit, with_sink_dimension


@dataclass(frozen=True)
class Segments:
    """The segment boundaries of a micro-batch. Unit u is `prefix[u]` tokens, then segments `completions[u]`
    (each attends to the prefix and itself). Not packed: unit r is row r of the micro-batch, then padding up to
    its width. Packed: the micro-batch is one row holding the units one after another, then padding."""

    prefix: tuple[int, ...]
    completions: tuple[tuple[int, ...], ...]
    packed: bool = False

    def __post_init__(self):
        if len(self.prefix) != len(self.completions):
            raise ValueError(f"Segments: {len(self.prefix)} prefixes for {len(self.completions)} rows")
        if any(p < 0 for p in self.prefix) or any(c < 0 for cs in self.completions for c in cs):
            raise ValueError("Segments: negative segment length")

    @classmethod
    def plain(cls, lengths, packed: bool = False) -> Segments:
        """Each sequence one causal segment of lengths[i] tokens: a row each (the padded layout), or packed."""
        lengths = tuple(int(n) for n in lengths)
        return cls(prefix=lengths, completions=tuple(() for _ in lengths), packed=packed)

    @property
    def num_rows(self) -> int:
        """Rows of the micro-batch (1 when packed)."""
        return 1 if self.packed else len(self.prefix)

    def units(self, row: int) -> range:
        """The units laid out in row `row`."""
        return range(len(self.prefix)) if self.packed else range(row, row + 1)

    def unit_length(self, unit: int) -> int:
        """Real tokens of unit `unit` (prefix and segments)."""
        return self.prefix[unit] + sum(self.completions[unit])

    def length(self, row: int) -> int:
        """Real tokens of row `row` (its units' prefixes and segments)."""
        return sum(self.unit_length(u) for u in self.units(row))

    def pairs(self) -> int:
        """Query-key pairs the kernel computes over all rows (the module docstring's formula)."""
        return sum(row_pairs(p, cs) for p, cs in zip(self.prefix, self.completions))


def row_pairs(prefix: int, completions) -> int:
    """Query-key pairs of one row: P (P + 1) / 2 + sum_j c_j (P + (c_j + 1) / 2), exactly (an integer)."""
    return prefix * (prefix + 1) // 2 + sum(c * prefix + c * (c + 1) // 2 for c in completions)


def attend_rows(query: Tensor, key: Tensor, value: Tensor, segs: Segments, scale: float | None = None, *,
                checkpoint_completions: bool = True, window: int | None = None,
                sinks: Tensor | None = None) -> Tensor:
    """query / key [S, B, Hq / Hkv, D], value [S, B, Hkv, Dv] (Megatron's layout) -> context [S, B, Hq, Dv] of
    `segs` (see the module docstring); Hq a multiple of Hkv (GQA); scale None: 1 / sqrt(D). checkpoint_completions
    False: completion calls are not checkpointed here, for a caller whose attention is recomputed whole already
    (trainer.recompute).

    Dv may differ from D (multi-latent attention: DeepSeek-V3's q / k are 192 wide, v 128): torch's fused CPU and
    CUDA kernels take only equal widths and would fall to the math kernel (a materialised score matrix), so the
    narrower side is zero-padded to the wider and the output sliced back to Dv: zero columns of V add zero columns
    to the output; zero columns of q and k add nothing to a score (the scale is fixed before padding).

    Rows and segments are taken with unbind / split, whose backward concatenates the pieces' gradients once (a
    slice's backward would fill a zero tensor of the whole input per slice).

    window W (None: none): a query sees itself and the W - 1 keys before it in its unit; sinks [Hq] (None: none): a
    learned logit per query head joins each softmax (windows.py: both exact, one extra key per head)."""
    dim, value_dim = query.shape[-1], value.shape[-1]
    if window is not None or sinks is not None:
        if value_dim != dim:
            raise NotImplementedError("sliding windows / attention sinks with value width != query width")
        if window is not None and window < 1:
            raise ValueError(f"sliding window {window}: must be >= 1")
        scale = scale if scale is not None else dim ** -0.5
        query, key, value = with_sink_dimension(query, key, value, sinks, scale)
        return _attend_rows(query, key, value, segs, scale, checkpoint_completions, window, True,
                            sinks is not None)[..., :dim]
    return _attend_rows(query, key, value, segs, scale, checkpoint_completions, None, False, False)


def equal_widths(query: Tensor, key: Tensor, value: Tensor, scale: float | None
                 ) -> tuple[Tensor, Tensor, Tensor, float]:
    """(query, key, value, scale) with the narrower of D (query / key) and Dv (value) zero-padded to the wider, the
    scale fixed at D's first (attend_rows' docstring says why the output is the same, sliced back to Dv)."""
    dim, value_dim = query.shape[-1], value.shape[-1]
    scale = scale if scale is not None else dim ** -0.5
    if value_dim < dim:
        return query, key, F.pad(value, (0, dim - value_dim)), scale
    return F.pad(query, (0, value_dim - dim)), F.pad(key, (0, value_dim - dim)), value, scale


def _attend_rows(query: Tensor, key: Tensor, value: Tensor, segs: Segments, scale: float | None,
                 checkpoint_completions: bool, window: int | None, windowed: bool, sink: bool) -> Tensor:
    """attend_rows once the widths are settled (windowed: windows.py's calls; sink: the sink dimension is in)."""
    value_dim = value.shape[-1]
    if value_dim != query.shape[-1]:
        query, key, value, scale = equal_widths(query, key, value, scale)
        return _attend_rows(query, key, value, segs, scale, checkpoint_completions, window, windowed,
                            sink)[..., :value_dim]
    width, batch, heads, dim = query.shape
    if segs.num_rows != batch:
        raise ValueError(f"Segments of {segs.num_rows} rows for a micro-batch of {batch}")
    gqa = key.shape[2] != heads
    rows = []
    for b, (q, k, v) in enumerate(zip(query.unbind(1), key.unbind(1), value.unbind(1))):  # [S, H, D] each
        units = segs.units(b)
        pad = width - segs.length(b)
        if pad < 0:
            raise ValueError(f"row {b}: segments of {segs.length(b)} tokens in a width of {width}")
        sizes = [n for u in units for n in (segs.prefix[u], *segs.completions[u])] + [pad]
        # [1, H, n, D] views (the flash kernel for CPU takes 4-d inputs; 3-d ones fall back to the math kernel)
        qs, ks, vs = (x.transpose(0, 1)[None].split(sizes, dim=2) for x in (q, k, v))
        pieces, first = [], 0
        for u in units:
            n = 1 + len(segs.completions[u])
            if windowed:
                pieces += attend_windowed_unit(qs[first:first + n], ks[first:first + n], vs[first:first + n], scale,
                                               gqa, window, sink,
                                               checkpointed_call if checkpoint_completions else _call)
            else:
                pieces += _attend_unit(qs[first:first + n], ks[first:first + n], vs[first:first + n], scale, gqa,
                                       checkpoint_completions)
            first += n
        if pad:
            pieces.append(query.new_zeros(1, heads, pad, dim))
        rows.append(torch.cat(pieces, dim=2)[0].transpose(0, 1))  # [S, H, D]
    return torch.stack(rows, dim=1)


def checkpointed_call(fn, *args):
    """fn(*args) under non-reentrant activation checkpointing where a backward will follow."""
    return checkpoint(fn, *args, use_reentrant=False) if torch.is_grad_enabled() else fn(*args)


def _call(fn, *args):
    return fn(*args)


def _attend_unit(qs, ks, vs, scale: float | None, gqa: bool, checkpoint_completions: bool = True) -> list[Tensor]:
    """One unit's pieces ([1, H, n, D] each: the prefix, then its completions) -> their outputs (empty pieces
    dropped): the prefix causal, each completion against [prefix ; completion] (see the module docstring)."""
    p = qs[0].shape[2]
    out = []
    if p:
        k, v, prefix_gqa = kernel_kv(qs[0], ks[0], vs[0], gqa)
        out.append(F.scaled_dot_product_attention(qs[0], k, v, is_causal=True, scale=scale, enable_gqa=prefix_gqa))
    for j in range(1, len(qs)):
        if qs[j].shape[2] == 0:
            continue
        # with a prefix: keep no gathered K/V, recompute it
        call = checkpointed_call if p and checkpoint_completions else _call
        out.append(call(lower_right_attention, qs[j], ks[0], ks[j], vs[0], vs[j], scale, gqa))
    return out


def lower_right_attention(q: Tensor, k_prefix: Tensor, k: Tensor, v_prefix: Tensor, v: Tensor,
                          scale: float | None, gqa: bool) -> Tensor:
    """Queries q [1, H, n, D] against keys and values [prefix ; k] ([1, H, ., D] pieces, K keys in all, K >= n),
    the causality aligned bottom-right: query i sees keys 0 .. K - n + i. A completion against [prefix ;
    itself] (K - n = the prefix); under CP a run of held columns against its segment up to the run's end
    (attention/context_split.py)."""
    count = q.shape[2]
    if k_prefix.shape[2]:
        k, v = torch.cat((k_prefix, k), dim=2), torch.cat((v_prefix, v), dim=2)
    keys = k.shape[2]
    kk, vv, gqa = kernel_kv(q, k, v, gqa)
    if q.is_cuda:  # the lower-right variant has native flash / memory-efficient kernels there
        # imported here: torch.nn.attention.bias pulls in torch._dynamo, seconds of import a CPU rank never needs
        # (compat/megatron_import.py keeps it out)
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(count, keys)
    else:  # what causal_lower_right materialises on CPU: query i sees keys 0 .. K - n + i
        mask = torch.ones(count, keys, dtype=torch.bool, device=q.device).tril(keys - count)
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale, enable_gqa=gqa)


def fused_kernel_takes_gqa(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether torch's fused kernel for this call takes GQA (Hkv < Hq heads). On CPU its flash kernel does. On CUDA
    only flash does (torch's memory-efficient kernel refuses enable_gqa), and flash refuses fp32 (and GPUs before
    sm80): asked through torch.backends.cuda.can_use_flash_attention, as CausalBias's own dispatch asks it."""
    if not q.is_cuda:
        return True
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, True)
    return torch.backends.cuda.can_use_flash_attention(params)


def kernel_kv(q: Tensor, k: Tensor, v: Tensor, gqa: bool) -> tuple[Tensor, Tensor, bool]:
    """Keys, values and enable_gqa for one SDPA call whose fused kernel would not take GQA: K/V heads repeated per
    query head (what enable_gqa computes, torch's documented reference: repeat_interleave on the head dimension), so
    that on CUDA in fp32 the memory-efficient kernel runs (with the lower-right mask natively) instead of torch's
    math kernel, which holds a [c, P + c] mask and score matrix per head. The copy is Hq / Hkv times the call's keys
    and values, far below the scores it spares. Otherwise the inputs as given."""
    if not gqa or fused_kernel_takes_gqa(q, k, v):
        return k, v, gqa
    repeat = q.shape[1] // k.shape[1]
    return k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1), False


def unsupported(config, cp: int | None = None) -> str | None:
    """Why a Megatron TransformerConfig's attention is not what attend_rows computes (None: it is). Windows are
    Megatron's `window_size` (left, 0) (a reach of left + 1 keys, windows.py) on the layers `window_attn_skip_freq`
    picks; sinks its softmax_type 'learnable' (`softmax_offset`); neither, nor multi-latent attention, under
    context parallelism (not built). cp: the context-parallel size the layer runs at (the model reads it from the
    process groups: context_parallel.layer_cp_size); None: the config's context_parallel_size."""
    if cp is None:
        cp = getattr(config, "context_parallel_size", 1)
    window = getattr(config, "window_size", None)
    if window is not None and (len(window) != 2 or window[1] != 0 or window[0] < 0):
        return f"window_size {tuple(window)!r} (only (left, 0): a causal window)"
    if getattr(config, "softmax_type", "vanilla") not in ("vanilla", "learnable"):
        return f"softmax_type {config.softmax_type!r} (only vanilla, or learnable: attention sinks)"
    if cp != 1 and (
            window is not None or getattr(config, "softmax_type", "vanilla") != "vanilla"):
        return "context parallelism with sliding windows / attention sinks"
    if cp != 1 and getattr(config, "multi_latent_attention", False):
        return "context parallelism with multi-latent attention"
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout"
    if getattr(config, "apply_query_key_layer_scaling", False):
        return "query-key layer scaling"
    return None
