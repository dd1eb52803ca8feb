"""The output layer and the log-softmax of the scored tokens as one autograd function.

    logp, entropy = linear_logprobs(hidden, weight, labels, vocab_size, temperature=T, with_entropy=True)

For hidden states h [N, H], the output weight W [V_pad, H] (rows past `vocab_size` are Megatron's padding) and
labels y [N]:

    z_n    = (W[:vocab_size] h_n) / T          fp32 (fp64 for fp64 inputs), whatever the inputs' dtype:
             head_dtype "float32":  fp32(W) fp32(h_n)        the bf16 values cast up, products and sums in fp32
             head_dtype "model":    fp32(bf16(W h_n))        a bf16 matmul, its bf16 logits cast up
    logp_n = z_n[y_n] - logsumexp(z_n)
    H_n    = -sum_v p_nv log p_nv,        p_n = softmax(z_n)       (a metric: no gradient)

and in backward, with g_n = dL/dlogp_n,

    dL/dz_n = g_n (onehot(y_n) - p_n),   dL/dh = (dL/dz / T) W[:vocab_size],   dL/dW[:vocab_size] = (dL/dz / T)^T h

each gradient returned in its input's dtype (head_dtype "float32": the two products in fp32 and rounded once at
the end; "model": dL/dz rounded to bf16 first and the products in bf16). In fp32 the two head_dtypes are one.

Why fp32 in bf16. vLLM's `hf_overrides={"head_dtype": "float32"}` (rollout.head_dtype) computes the engine's
logits as `F.linear(h.float(), W.float())` on CPU and as `torch.mm(h, W.t(), out_dtype=float32)` on CUDA: the
same exact products of bf16 values, summed in fp32. A bf16 head instead rounds every logit to 8 bits of mantissa
(|z| ~ 20: steps of 0.125) before the log-softmax, on each side separately: most of the bf16 engine-trainer
log-prob gap (docs/real-models.md, "The anchor gap, measured").

Why. Composed from aten ops, the scored tokens' logits [N, V] are saved for backward and backward then allocates
logsumexp's exp(z - lse), gather's zero-filled scatter and their sum, each another [N, V] fp32 tensor (V = 49,152
for SmolLM2: 88 MB per 450 scored tokens each). Here the logits buffer is turned into p in place in forward, p
into dL/dz in place in backward: one [N, V] tensor for the whole head, and one pass over it each way. The
output-layer matmuls are the same as the layer's own (one mm each, whatever the weight's requires_grad), so
nothing is recomputed.

What holds in which dtype. In fp32 the one [N, V] fp32 buffer is the whole head's memory, each way. In bf16 (or
fp16) with head_dtype "float32" the buffer is filled VOCAB_CHUNK vocabulary rows at a time from an fp32 copy of
those weight rows ([VOCAB_CHUNK, H]) and an fp32 copy of h ([N, H]), each product an [N, VOCAB_CHUNK] fp32
temporary; the backward likewise takes the weight and its gradient VOCAB_CHUNK rows at a time in fp32 and holds
an [N, H] fp32 copy of h and an [N, H] fp32 dL/dh: about one fp32 [N, V] buffer at the peak each way, never an
fp32 copy of the whole weight. With head_dtype "model" the matmul first makes an [N, V] bf16 tensor and
`.to(float32)` the fp32 buffer from it (the bf16 one is freed at once, but both live at that moment), and the
backward makes a bf16 copy of the fp32 gradient for the matmuls: about 1.5 x one fp32 [N, V] buffer at the peak
each way (review R14). Both are checked against eager ops in bf16, tests/trainer/test_logprob_head.py.

The buffer is consumed by the backward: a second backward through the same graph raises (retain_graph is not
supported). One rank must hold the whole vocabulary (TP 1, or no vocabulary split); the vocabulary-parallel
head stays in trainer/logprobs.py.
"""
from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ROWS = 256  # rows of [rows, V] fp32 temporaries in forward (V = 49,152: 50 MB)
VOCAB_CHUNK = 8192  # weight rows cast to fp32 at a time by the fp32 head in bf16 (H = 2,048: 64 MB)
HEAD_DTYPES = ("float32", "model")


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, vocab_size: int, temperature: float,
                with_entropy: bool, chunk_rows: int, upcast: bool):
        w = weight[:vocab_size]
        # [N, V] in fp32 at least: logits now, p after the loop
        if upcast:
            probs = _upcast_logits(hidden, w)
        else:
            probs = (hidden @ w.t()).to(torch.promote_types(hidden.dtype, torch.float32))
        if temperature != 1.0:
            probs.div_(temperature)
        n = probs.shape[0]
        logp = probs.new_empty(n)
        entropy = probs.new_empty(n if with_entropy else 0)
        for start in range(0, n, chunk_rows):
            z = probs[start:start + chunk_rows]
            y = labels[start:start + chunk_rows]
            lse = torch.logsumexp(z, dim=-1)
            logp[start:start + chunk_rows] = z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - lse
            z.sub_(lse.unsqueeze(-1))  # log p
            if with_entropy:
                p = z.exp()
                entropy[start:start + chunk_rows] = -torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).view(-1)
                z.copy_(p)
                del p
            else:
                z.exp_()
        ctx.save_for_backward(hidden, weight, labels)
        ctx.probs = probs
        ctx.vocab_size, ctx.temperature, ctx.upcast = vocab_size, temperature, upcast
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, _grad_entropy):
        hidden, weight, labels = ctx.saved_tensors
        grad = ctx.probs
        if grad is None:
            raise RuntimeError("linear_logprobs: backward ran twice through one graph (its buffer is consumed; "
                               "retain_graph is not supported)")
        ctx.probs = None
        g = grad_logp.to(grad.dtype)
        # dL/dz = g (onehot(y) - p), in place on p
        grad.mul_(-g.unsqueeze(-1))
        grad.scatter_add_(-1, labels.unsqueeze(-1), g.unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        if ctx.upcast:
            grad_hidden, grad_weight = _upcast_grads(grad, hidden, weight, ctx.vocab_size, *ctx.needs_input_grad[:2])
            return grad_hidden, grad_weight, None, None, None, None, None, None
        grad = grad.to(hidden.dtype)
        w = weight[:ctx.vocab_size]
        grad_hidden = grad @ w if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros_like(weight)
            torch.mm(grad.t(), hidden, out=grad_weight[:ctx.vocab_size])
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _upcast_logits(hidden: Tensor, w: Tensor) -> Tensor:
    """[N, V] fp32 logits fp32(h) fp32(w)^T, the weight cast VOCAB_CHUNK rows at a time."""
    h = hidden.float()
    logits = h.new_empty(h.shape[0], w.shape[0])
    for a in range(0, w.shape[0], VOCAB_CHUNK):
        logits[:, a:a + VOCAB_CHUNK] = h @ w[a:a + VOCAB_CHUNK].float().t()
    return logits


def _upcast_grads(grad: Tensor, hidden: Tensor, weight: Tensor, vocab_size: int, want_hidden: bool,
                  want_weight: bool) -> tuple[Tensor | None, Tensor | None]:
    """dL/dh = grad fp32(W) and dL/dW = grad^T fp32(h) from the fp32 dL/dz `grad` [N, V], in fp32, each rounded
    once to its input's dtype; the weight (and its gradient) VOCAB_CHUNK rows at a time."""
    h = hidden.float()
    grad_hidden = torch.zeros_like(h) if want_hidden else None
    grad_weight = torch.zeros_like(weight) if want_weight else None  # padded vocabulary rows get 0
    for a in range(0, vocab_size, VOCAB_CHUNK):
        b = min(a + VOCAB_CHUNK, vocab_size)
        g = grad[:, a:b]
        if want_hidden:
            grad_hidden.addmm_(g, weight[a:b].float())
        if want_weight:
            grad_weight[a:b] = g.t() @ h  # the copy rounds to the weight's dtype
    return (None if grad_hidden is None else grad_hidden.to(hidden.dtype)), grad_weight


def upcasts_head(head_dtype: str, dtype: torch.dtype) -> bool:
    """Whether an output layer in `dtype` runs on inputs cast to fp32 (head_dtype "float32" in bf16 / fp16)."""
    if head_dtype not in HEAD_DTYPES:
        raise ValueError(f"trainer.head_dtype {head_dtype!r}; valid: {', '.join(HEAD_DTYPES)}")
    return head_dtype == "float32" and torch.promote_types(dtype, torch.float32) != dtype


def linear_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, vocab_size: int | None = None, *,
                    temperature: float = 1.0, with_entropy: bool = False, chunk_rows: int = CHUNK_ROWS,
                    head_dtype: str = "float32") -> tuple[Tensor, Tensor | None]:
    """hidden [N, H], weight [V_pad, H], labels [N] long -> logp [N] (fp32, fp64 for fp64 inputs; differentiable
    in hidden and weight) and entropy [N] (detached) or None. `vocab_size`: the real vocabulary (default V_pad);
    `temperature` T > 0 scores softmax(logits / T) (T = 0, greedy, counts as 1 as in vLLM). `head_dtype`
    (bf16 / fp16 inputs): "float32" computes the logits from the inputs cast to fp32, "model" in their dtype."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_logprobs: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be "
                         "[N, H] and [V, H]")
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    temperature = 1.0 if temperature <= 0 else float(temperature)
    logp, entropy = _LinearLogprobs.apply(hidden, weight, labels, vocab_size, temperature, with_entropy,
                                          max(1, chunk_rows), upcasts_head(head_dtype, hidden.dtype))
    return logp, (entropy if with_entropy else None)
