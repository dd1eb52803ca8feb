"""Per-token log-probs (and optionally entropies) of a Megatron GPTModel, under any TP/SP/EP/DP layout.

    logp = forward_logprobs(model, tokens, lengths)                         # [B, L]
    logp, entropy = forward_logprobs(model, tokens, lengths, with_entropy=True)

`logp[b, t] = log p(tokens[b, t] | tokens[b, :t])` for 1 <= t < lengths[b]; 0 at t = 0 and on right padding.
`entropy[b, t]` is the entropy of the same next-token distribution (the one that scored tokens[b, t]).
Differentiable; every rank gets the full [B, L] (all TP ranks must pass the same tokens, as Megatron requires).
Log-softmax is taken over the real vocabulary only: rows Megatron adds to make the vocabulary divisible by TP are
excluded, so padding never changes the numbers.

Cost. The output layer and the log-softmax over a large vocabulary (49,152 for SmolLM2) dominate memory and much of
the time when every position is scored, yet the loss needs only completion tokens. `score_mask` names the tokens
whose log-probs are wanted: the output layer then runs on those positions only (unless sequence parallelism shards
the positions). With the whole vocabulary on one rank (TP 1) the output layer and the log-softmax run as one
autograd function (trainer/logprob_head.py: one [N, V] buffer for logits, probabilities and their gradient);
under a vocabulary split (TP > 1) the output layer makes the [N, V/tp] logits and the log-softmax is one autograd
function over row chunks (`compute_vocab_parallel_logprobs`): fp32 temporaries of LOGSOFTMAX_CHUNK_ROWS rows,
nothing but [N] vectors kept for the backward, which recomputes the softmax chunk by chunk into the one
[N, V/tp] gradient. Under sequence parallelism the output layer still makes logits for every position (it gathers
the position shards first) and the scored rows are then indexed out: a [S x B, V/tp] tensor this code does not
chunk. The entropy (a metric) is computed without a graph.

Head dtype. In a bf16 model, `head_dtype="float32"` (trainer.head_dtype, the default) runs the output layer on
the bf16 hidden states and weight cast to fp32 (fp32 logits: z = fp32(W) fp32(h), exact products of the bf16
values summed in fp32, what vLLM's head_dtype float32 computes) and the log-softmax on those; "model" runs a bf16
matmul and casts its bf16 logits up for the log-softmax (z = fp32(bf16(W h))). The log-softmax is fp32 either
way. Under a vocabulary split the fp32 head hands Megatron's own output layer fp32 inputs and an fp32 copy of
this rank's [V/tp, H] weight slice (its gradient flows back to the bf16 weight through the cast); under sequence
parallelism its all-gather of the position shards then moves fp32.

Pipeline stages. On a stage before the last (trainer.pp; the model built without its output layer) both functions
return the stage's output hidden states [S, B, H] instead, what Megatron's schedule sends to the next stage
(trainer/pipeline.py); a stage after the first reads its input from the schedule (`set_input_tensor`), the tokens
only shaping the layout (segments, positions), which every stage rebuilds from its micro-batch.

Shared prefixes and packed rows. `forward_group_logprobs(model, tokens, lengths, layout)` returns the same [B, L]
numbers from one forward of the rows' `group_rows.GroupLayout`: group rows (each prompt once per group row, its
completions as segments that attend to the prompt and to themselves), or one packed row [s_1 | s_2 | .. | tail]
of sequences or group rows of different lengths (no padding between them; positions restart at 0 in each; the
log-prob of token t of row b is read at its own column of the packed output, `layout.col_of[b, t - 1]`).
`forward_logprobs` is the padded layout ([B, L], each row causal from position 0).

Context parallelism (trainer.cp). Either layout's rows are padded to a multiple of 2 x CP and each CP rank forwards
its zig-zag columns of them (attention/context_split.py), scores the tokens those columns predict, and the [N]
log-probs are summed over the CP ranks (`_score`), so every rank returns the whole [B, L], as at CP 1.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from gspo_ray.compat.torch_matmul_fold import foldable_grad
from gspo_ray.trainer.logprob_head import linear_logprobs, upcasts_head
from gspo_ray.trainer.attention.segment_attention import Segments
from gspo_ray.trainer.attention.context_split import width_multiple as context_width_multiple
from gspo_ray.trainer.context_parallel import cp_split, cp_sum


LOGSOFTMAX_CHUNK_ROWS = 1024  # rows of [rows, V / tp] fp32 temporaries at a time (V = 151,936, TP 8: 78 MB)


def compute_vocab_parallel_logprobs(logits: Tensor, labels: Tensor, vocab_size: int, group=None,
                                    with_entropy: bool = False, temperature: float = 1.0,
                                    chunk_rows: int = LOGSOFTMAX_CHUNK_ROWS) -> tuple[Tensor, Tensor | None]:
    """log_softmax(logits / T)[labels] (and entropy) when the vocabulary is split over the TP group (or whole, group
    None), row chunk by row chunk.

    logits: [N, V_local] this rank's contiguous vocabulary slice (rank r holds rows [r*V_local, (r+1)*V_local)), in
    fp32 (an fp32 head) or the model's dtype (cast to fp32 chunk by chunk here);
    labels: [N] global token ids. `vocab_size` real entries; anything beyond is Megatron's padding and ignored.
    Returns fp32 logp [N] (differentiable in logits) and entropy [N] (no graph) or None, identical on every rank.
    Memory: the fp32 temporaries are [chunk_rows, V_local] at a time; between forward and backward only the logits
    (the caller's) and [N] vectors are kept; the backward makes the one [N, V_local] gradient, chunk by chunk.
    """
    rank = torch.distributed.get_rank(group) if group is not None and group.size() > 1 else 0
    part = logits.shape[-1]
    start = rank * part
    if vocab_size <= start:
        raise ValueError(f"TP rank {rank} holds only padded vocabulary rows (vocab {vocab_size}, {part} per rank)")
    scale = 1.0 / temperature if temperature > 0 else 1.0  # T = 0 (greedy) counts as 1, as in vLLM
    return _VocabLogprob.apply(logits, labels, start, min(part, vocab_size - start), scale, group, chunk_rows,
                               with_entropy)


class _VocabLogprob(torch.autograd.Function):
    """logp[n] = z[n, y_n] - log sum_v exp z[n, v], z = scale x logits[:, :real] (this rank's real columns),
    the sums over the TP group; backward: dlogp / dz = onehot(y) - softmax(z), recomputed chunk by chunk."""

    @staticmethod
    def forward(ctx, logits, labels, start, real, scale, group, chunk, with_entropy):
        n = logits.shape[0]
        dist = group is not None and group.size() > 1
        peak = logits.new_empty(n, dtype=torch.float32)
        for a in range(0, n, chunk):  # the max only stabilises exp(); it carries no gradient
            peak[a:a + chunk] = logits[a:a + chunk, :real].float().max(dim=-1).values * scale
        if dist:
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX, group=group)
        sums = torch.zeros_like(peak)
        weighted = torch.zeros_like(peak) if with_entropy else None
        for a in range(0, n, chunk):
            z = logits[a:a + chunk, :real].float() * scale - peak[a:a + chunk, None]
            e = z.exp()
            sums[a:a + chunk] = e.sum(dim=-1)
            if with_entropy:
                weighted[a:a + chunk] = (e * z).sum(dim=-1)
        local = labels - start
        mine = (local >= 0) & (local < real)
        rows = torch.arange(n, device=logits.device)
        picked = logits[rows, local.clamp(0, real - 1)].float() * scale - peak
        picked = torch.where(mine, picked, torch.zeros_like(picked))
        parts = torch.stack([sums, picked] + ([weighted] if with_entropy else []))
        if dist:
            torch.distributed.all_reduce(parts, group=group)
        log_sum = parts[0].log()
        ctx.save_for_backward(logits, local, mine, peak + log_sum)  # log Z, absolute
        ctx.real, ctx.scale, ctx.chunk = real, scale, chunk
        logp = parts[1] - log_sum
        if not with_entropy:
            return logp, None
        entropy = log_sum - parts[2] / parts[0]  # H = log Z - sum_v p_v z_v (z shifted by the max)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        logits, local, mine, log_z = ctx.saved_tensors
        real, scale, chunk = ctx.real, ctx.scale, ctx.chunk
        grad = torch.zeros_like(logits)  # Megatron's padded vocabulary columns get 0
        g = grad_logp.float() * scale
        for a in range(0, logits.shape[0], chunk):
            p = (logits[a:a + chunk, :real].float() * scale - log_z[a:a + chunk, None]).exp()
            grad[a:a + chunk, :real] = (-p * g[a:a + chunk, None]).to(grad.dtype)
        rows = mine.nonzero().flatten()
        grad[rows, local[rows]] += g[rows].to(grad.dtype)
        return grad, None, None, None, None, None, None, None


@contextlib.contextmanager
def output_rows(inner, seq_idx: Tensor | None, batch_idx: Tensor | None, upcast: bool = False):
    """Within the block, `inner.output_layer` computes logits for hidden_states[seq_idx, batch_idx] only (an
    [N, 1, H] input, so GPTModel returns [1, N, V]); seq_idx None: for every position, as the layer itself does
    (under sequence parallelism, where the layer first gathers position shards). upcast: the layer's matmul runs
    on its input and weight cast to fp32 (fp32 logits; `upcast_head_inputs`)."""
    layer = inner.output_layer
    original = layer.forward

    def forward(hidden_states, *args, weight=None, **kwargs):
        if seq_idx is not None:
            hidden_states = hidden_states[seq_idx, batch_idx].unsqueeze(1)
        if upcast:
            hidden_states, weight = upcast_head_inputs(layer, hidden_states, weight)
        logits, bias = original(hidden_states, *args, weight=weight, **kwargs)
        # a frozen output layer (LoRA) would otherwise take its input gradient as N matrix-vector products
        return (logits if seq_idx is None else foldable_grad(logits)), bias

    with _output_forward(inner, forward):
        yield


def upcast_head_inputs(layer, hidden_states: Tensor, weight: Tensor | None) -> tuple[Tensor, Tensor]:
    """The output layer's input and weight (its own, or the tied embedding GPTModel passes) cast to fp32: autograd
    returns their gradients through the casts, in their own dtypes."""
    weight = layer.weight if weight is None else weight
    return hidden_states.float(), weight.float()


@contextlib.contextmanager
def output_hidden(inner, seq_idx: Tensor, batch_idx: Tensor, weights: list):
    """Within the block, `inner.output_layer` returns hidden_states[seq_idx, batch_idx] ([N, 1, H], so GPTModel
    returns [1, N, H]) instead of logits, and appends the weight it would have used (its own, or the tied
    embedding's) to `weights`: the caller runs the output layer fused with the log-softmax (logprob_head.py).
    Valid where the output layer is a plain x W^T on one rank: TP 1, no bias."""
    layer = inner.output_layer

    def forward(hidden_states, *args, weight=None, **kwargs):
        weights.append(layer.weight if weight is None else weight)
        return hidden_states[seq_idx, batch_idx].unsqueeze(1), None

    with _output_forward(inner, forward):
        yield


@contextlib.contextmanager
def _output_forward(inner, forward):
    """`inner.output_layer.forward` replaced by `forward` within the block (an instance attribute, removed after)."""
    layer = inner.output_layer
    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward  # the class's forward again


def _unwrap(model):
    """DDP / Float16Module wrappers -> the GPTModel inside."""
    while not hasattr(model, "vocab_size") and hasattr(model, "module"):
        model = model.module
    return model


def forward_logprobs(model, tokens: Tensor, lengths: Tensor | None = None, *, with_entropy: bool = False,
                     vocab_size: int | None = None, score_mask: Tensor | None = None, temperature: float = 1.0,
                     head_dtype: str = "float32"):
    """tokens: [B, L] long (right padded), lengths: [B] or None (= L) -> logp [B, L] fp32 (, entropy [B, L]).

    `vocab_size` is the real vocabulary (defaults to the one build_model recorded, else the model's own).
    `score_mask` [B, L] bool: the tokens to score (e.g. the loss mask); others read 0. None = every valid token.
    `temperature` T: log-probs (and entropies) of softmax(logits / T), the distribution the rollout engine sampled
    from at that temperature; T = 0 (greedy) counts as 1, as in vLLM, which then reports unscaled log-probs.
    `head_dtype` "float32" | "model": the output layer's dtype in a bf16 model (module docstring, "Head dtype").
    Under sequence parallelism L is padded to a multiple of TP here (under context parallelism, of 2 x CP too:
    width_multiple) and cut back afterwards.
    """
    inner = _unwrap(model)
    device = next(inner.parameters()).device
    tokens = tokens.to(device)
    batch, length = tokens.shape
    multiple = width_multiple(inner)
    padded = -(-length // multiple) * multiple
    inputs = tokens
    if padded != length:
        inputs = torch.nn.functional.pad(tokens, (0, padded - length), value=0)
    position_ids = torch.arange(padded, device=device).unsqueeze(0).expand(batch, -1)
    valid = _valid_mask(batch, length, lengths, device)
    if score_mask is not None:
        valid = valid & score_mask.to(device).bool()
    b_idx, t_idx = valid.nonzero(as_tuple=True)  # scored tokens; position t - 1 predicts token t
    segs = Segments.plain([length] * batch if lengths is None else lengths.tolist())  # each row causal, alone
    scored = _score(model, inner, inputs, position_ids, segs, t_idx - 1, b_idx, tokens[b_idx, t_idx], vocab_size,
                    with_entropy, temperature, head_dtype, rope=False)
    return _scatter(scored, b_idx, t_idx, (batch, length), with_entropy)


def forward_group_logprobs(model, tokens: Tensor, lengths: Tensor, layout, *, with_entropy: bool = False,
                           vocab_size: int | None = None, score_mask: Tensor | None = None,
                           temperature: float = 1.0, head_dtype: str = "float32"):
    """forward_logprobs of rows tokens [B, L] / lengths [B], computed on their shared-prefix layout.

    `layout` is the `group_rows.GroupLayout` of exactly these rows: the model runs once on its rows (group rows:
    the prompt once per group row; packed: one row holding every sequence or group row; attention by segment
    (segment_attention.py), RoPE at the layout's positions) and token t of row b is scored by the output at column
    `layout.col_of[b, t - 1]` of row `layout.row_of[b]`, which attends to exactly tokens[b, :t] at positions
    0..t-1. Returns logp (, entropy) in the ORIGINAL [B, L] layout, equal to forward_logprobs(model, tokens,
    lengths, ...) up to float summation order. Under sequence parallelism the layout's width must be a multiple of
    TP (build_layout's width_multiple: a packed row's tail padding, which attends to nothing and is never scored),
    under context parallelism of 2 x CP too (`width_multiple`).
    """
    inner = _unwrap(model)
    device = next(inner.parameters()).device
    tokens = tokens.to(device)
    batch, length = tokens.shape
    width, multiple = layout.tokens.shape[1], width_multiple(inner)
    if width % multiple:
        raise ValueError(f"group layout width {width} is not a multiple of {multiple} (build it with "
                         "width_multiple: TP under sequence parallelism, times 2 x CP under context parallelism)")
    valid = _valid_mask(batch, length, lengths, device)
    if score_mask is not None:
        valid = valid & score_mask.to(device).bool()
    b_idx, t_idx = valid.nonzero(as_tuple=True)
    row_of, col_of = layout.row_of.to(device), layout.col_of.to(device)
    r_idx, s_idx = row_of[b_idx], col_of[b_idx, t_idx - 1]  # the column that predicts tokens[b, t]
    scored = _score(model, inner, layout.tokens.to(device), layout.position_ids.to(device), layout.segments, s_idx,
                    r_idx, tokens[b_idx, t_idx], vocab_size, with_entropy, temperature, head_dtype, rope=True)
    return _scatter(scored, b_idx, t_idx, (batch, length), with_entropy)


def width_multiple(inner) -> int:
    """What a forwarded row's width must be a multiple of: TP under sequence parallelism, times 2 x CP under
    context parallelism (its zig-zag chunks, attention/context_split.py)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size() if inner.config.sequence_parallel else 1
    return tp * context_width_multiple(parallel_state.get_context_parallel_world_size())


def _fused_head(inner) -> bool:
    """Whether the output layer can run fused with the log-softmax: the whole vocabulary on this rank, no bias."""
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_world_size() == 1 and not inner.config.sequence_parallel
            and getattr(inner.output_layer, "bias", None) is None)


def _score(model, inner, inputs: Tensor, position_ids: Tensor, segs: Segments, seq_idx: Tensor, batch_idx: Tensor,
           labels: Tensor, vocab_size: int | None, with_entropy: bool, temperature: float, head_dtype: str,
           rope: bool):
    """Log-probs [N] (, entropies [N]) of labels at (position seq_idx[n], row batch_idx[n]) of a forward of
    inputs [B, S] at position_ids (rope: RoPE at those positions, compat/megatron_rope_positions.py; else Megatron's
    0..S-1, which they are).

    Context parallelism: the model forwards this rank's columns only (context_parallel.cp_split), at their
    positions; each token is scored on the rank holding the column that predicts it, and the [N] vectors are summed
    over the CP ranks (context_parallel.cp_sum), so every rank returns all N."""
    from gspo_ray.compat.megatron_rope_positions import rope_positions

    split = cp_split(inputs.shape[1])
    if split is None:
        with rope_positions(model, position_ids) if rope else contextlib.nullcontext():
            return _score_local(model, inner, inputs, position_ids, segs, seq_idx, batch_idx, labels, vocab_size,
                                with_entropy, temperature, head_dtype)
    columns = split.columns.to(inputs.device)
    local = split.local_of.to(seq_idx.device)[seq_idx]
    mine = (local >= 0).nonzero().flatten()
    inputs, position_ids = inputs[:, columns], position_ids[:, columns]
    with rope_positions(model, position_ids):  # this rank's columns keep their own positions
        logp, entropy = _score_local(model, inner, inputs, position_ids, segs, local[mine], batch_idx[mine],
                                     labels[mine], vocab_size, with_entropy, temperature, head_dtype)
    n = seq_idx.shape[0]
    logp = cp_sum(logp.new_zeros(n).index_put((mine,), logp), split)
    if entropy is not None:
        entropy = cp_sum(entropy.new_zeros(n).index_put((mine,), entropy.detach()), split)
    return logp, entropy


def _score_local(model, inner, inputs: Tensor, position_ids: Tensor, segs: Segments, seq_idx: Tensor,
                 batch_idx: Tensor, labels: Tensor, vocab_size: int | None, with_entropy: bool, temperature: float,
                 head_dtype: str):
    """_score on the columns this rank forwards."""
    if not getattr(inner, "post_process", True):  # a pipeline stage before the last: its hidden states go on
        return model(inputs, position_ids, segs)
    vocab_size = vocab_size or getattr(inner, "hf_vocab_size", inner.vocab_size)
    if _fused_head(inner):
        weights: list = []
        with output_hidden(inner, seq_idx, batch_idx, weights):
            hidden = model(inputs, position_ids, segs)[0]
        return linear_logprobs(hidden, weights[0], labels, vocab_size, temperature=temperature,
                               with_entropy=with_entropy, head_dtype=head_dtype)
    head_weight = inner.output_layer.weight
    if head_weight is None:  # tied embeddings: GPTModel hands the layer the embedding's weight
        head_weight = inner.shared_embedding_or_output_weight()
    upcast = upcasts_head(head_dtype, head_weight.dtype)
    logits = _scored_logits(model, inner, inputs, position_ids, segs, seq_idx, batch_idx, upcast)
    return _logits_logprobs(logits, labels, vocab_size, with_entropy, temperature)


def _scored_logits(model, inner, inputs: Tensor, position_ids: Tensor, segs: Segments, seq_idx: Tensor,
                   batch_idx: Tensor, upcast: bool) -> Tensor:
    """[N, V/tp] logits at (position seq_idx[n], row batch_idx[n]) of a forward of inputs [B, S]; fp32 from
    fp32-cast inputs when `upcast`."""
    if inner.config.sequence_parallel:  # the output layer gathers position shards first: score afterwards
        with output_rows(inner, None, None, upcast) if upcast else contextlib.nullcontext():
            return model(inputs, position_ids, segs)[batch_idx, seq_idx]
    with output_rows(inner, seq_idx, batch_idx, upcast):
        return model(inputs, position_ids, segs)[0]


def _logits_logprobs(logits: Tensor, labels: Tensor, vocab_size: int, with_entropy: bool, temperature: float):
    """Log-probs [N] (, entropies [N]) of labels [N] under logits [N, V/tp] (the vocabulary split over TP)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    return compute_vocab_parallel_logprobs(logits, labels, vocab_size, group, with_entropy, temperature)


def _scatter(scored: tuple[Tensor, Tensor | None], b_idx: Tensor, t_idx: Tensor, shape: tuple[int, int],
             with_entropy: bool):
    """Per-token log-probs [N] (, entropies [N]) put at (b_idx, t_idx) of zeros of `shape`; a pipeline stage's
    hidden states (a tensor, not a pair: the stage before the last) pass through."""
    if isinstance(scored, Tensor):
        return scored
    logp_n, ent_n = scored
    device = logp_n.device
    logp = torch.zeros(*shape, device=device, dtype=logp_n.dtype).index_put((b_idx, t_idx), logp_n)
    if not with_entropy:
        return logp
    entropy = torch.zeros(*shape, device=device).index_put((b_idx, t_idx), ent_n.detach().float())
    return logp, entropy


def _valid_mask(batch: int, length: int, lengths: Tensor | None, device) -> Tensor:
    """[B, L] bool: True for 1 <= t < lengths[b] (position 0 has no prediction)."""
    pos = torch.arange(length, device=device).unsqueeze(0)
    upper = torch.full((batch, 1), length, device=device) if lengths is None else lengths.to(device).view(-1, 1)
    return (pos >= 1) & (pos < upper)
