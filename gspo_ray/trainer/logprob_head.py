"""The output layer and the log-softmax of the scored tokens as one autograd function.

    logp, entropy = linear_logprobs(hidden, weight, labels, vocab_size, temperature=T, with_entropy=True)

For hidden states h [N, H], the output weight W [V_pad, H] (rows past `vocab_size` are Megatron's padding) and
labels y [N]:

    z_n    = (W[:vocab_size] h_n) / T
    logp_n = z_n[y_n] - logsumexp(z_n)
    H_n    = -sum_v p_nv log p_nv,        p_n = softmax(z_n)       (a metric: no gradient)

and in backward, with g_n = dL/dlogp_n,

    dL/dz_n = g_n (onehot(y_n) - p_n),   dL/dh = (dL/dz / T) W[:vocab_size],   dL/dW[:vocab_size] = (dL/dz / T)^T h

Why. Composed from aten ops, the scored tokens' logits [N, V] are saved for backward and backward then allocates
logsumexp's exp(z - lse), gather's zero-filled scatter and their sum, each another [N, V] fp32 tensor (V = 49,152
for SmolLM2: 88 MB per 450 scored tokens each). Here the logits buffer is turned into p in place in forward, p
into dL/dz in place in backward: one [N, V] tensor for the whole head, and one pass over it each way. The
output-layer matmuls are the same as the layer's own (one mm each, whatever the weight's requires_grad), so
nothing is recomputed.

What holds in which dtype. In fp32 the one [N, V] fp32 buffer is the whole head's memory, each way. In bf16 (or
fp16) the matmul first makes an [N, V] bf16 tensor and `.to(float32)` the fp32 buffer from it (the bf16 one is
freed at once, but both live at that moment), and the backward makes a bf16 copy of the fp32 gradient for the
matmuls: about 1.5 x one fp32 [N, V] buffer at the peak each way (review R14; the values are checked against eager
ops in bf16 too, tests/trainer/test_logprob_head.py).

The buffer is consumed by the backward: a second backward through the same graph raises (retain_graph is not
supported). One rank must hold the whole vocabulary (TP 1, or no vocabulary split); the vocabulary-parallel
head stays in trainer/logprobs.py.
"""
from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ROWS = 256  # rows of [rows, V] fp32 temporaries in forward (V = 49,152: 50 MB)


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, vocab_size: int, temperature: float,
                with_entropy: bool, chunk_rows: int):
        w = weight[:vocab_size]
        # [N, V] in fp32 at least: logits now, p after the loop
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
        ctx.vocab_size, ctx.temperature = vocab_size, temperature
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
        grad = grad.to(hidden.dtype)
        w = weight[:ctx.vocab_size]
        grad_hidden = grad @ w if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros_like(weight)
            torch.mm(grad.t(), hidden, out=grad_weight[:ctx.vocab_size])
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, vocab_size: int | None = None, *,
                    temperature: float = 1.0, with_entropy: bool = False,
                    chunk_rows: int = CHUNK_ROWS) -> tuple[Tensor, Tensor | None]:
    """hidden [N, H], weight [V_pad, H], labels [N] long -> logp [N] (fp32, fp64 for fp64 inputs; differentiable
    in hidden and weight) and entropy [N] (detached) or None. `vocab_size`: the real vocabulary (default V_pad);
    `temperature` T > 0 scores softmax(logits / T) (T = 0, greedy, counts as 1 as in vLLM)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_logprobs: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be "
                         "[N, H] and [V, H]")
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    temperature = 1.0 if temperature <= 0 else float(temperature)
    logp, entropy = _LinearLogprobs.apply(hidden, weight, labels, vocab_size, temperature, with_entropy,
                                          max(1, chunk_rows))
    return logp, (entropy if with_entropy else None)
