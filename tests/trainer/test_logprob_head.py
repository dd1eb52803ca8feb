"""The fused output-layer + log-softmax head against the same maths in eager aten ops: values, entropies and the
gradients of the hidden states and the weight, with padded vocabulary rows, temperatures and several chunks; in
bf16 the fp32 head (the default) against fp32 maths on the bf16 values, the model-dtype head against bf16 logits."""
import pytest
import torch

from gspo_ray.trainer import logprob_head
from gspo_ray.trainer.logprob_head import linear_logprobs
from tests.tolerance import rounding_bound


def _eager(hidden, weight, labels, vocab_size, temperature):
    logits = (hidden @ weight[:vocab_size].t()).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy.detach()


def _case(n=37, h=16, v_pad=53, vocab=50, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype) * 2
    weight = torch.randn(v_pad, h, generator=g, dtype=dtype)
    labels = torch.randint(0, vocab, (n,), generator=g)
    coef = torch.randn(n, generator=g, dtype=torch.float64)
    return hidden, weight, labels, coef


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [256, 5])
def test_matches_eager_values_and_gradients(temperature, chunk_rows):
    hidden, weight, labels, coef = _case()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = linear_logprobs(h1, w1, labels, 50, temperature=temperature, with_entropy=True,
                                chunk_rows=chunk_rows)
    ref_logp, ref_ent = _eager(h2, w2, labels, 50, temperature)
    torch.testing.assert_close(logp.double(), ref_logp.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent.double(), rtol=1e-5, atol=1e-5)
    assert not ent.requires_grad
    (logp.double() * coef).sum().backward()
    (ref_logp.double() * coef).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(w1.grad[50:]) == 0  # padded rows get no gradient


def test_fp32_and_frozen_weight():
    hidden, weight, labels, coef = _case(dtype=torch.float32, seed=1)
    h1 = hidden.clone().requires_grad_()
    h2 = hidden.clone().requires_grad_()
    logp, ent = linear_logprobs(h1, weight, labels, 50)
    assert ent is None and logp.dtype == torch.float32
    ref, _ = _eager(h2, weight, labels, 50, 1.0)
    torch.testing.assert_close(logp, ref, rtol=1e-5, atol=1e-5)
    (logp * coef.float()).sum().backward()
    (ref * coef.float()).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-4, atol=1e-5)


def test_bf16_model_head_close_to_eager_on_the_same_bf16_logits():
    hidden, weight, labels, _ = _case(dtype=torch.bfloat16, seed=2)
    logp, ent = linear_logprobs(hidden, weight, labels, 50, with_entropy=True, head_dtype="model")
    ref, ref_ent = _eager(hidden, weight, labels, 50, 1.0)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)


def test_greedy_temperature_counts_as_one_and_empty_rows():
    hidden, weight, labels, _ = _case(seed=3)
    a, _ = linear_logprobs(hidden, weight, labels, 50, temperature=0.0)
    b, _ = linear_logprobs(hidden, weight, labels, 50, temperature=1.0)
    assert torch.equal(a, b)
    h = torch.zeros(0, 16, dtype=torch.float64, requires_grad=True)
    logp, ent = linear_logprobs(h, weight, labels[:0], 50, with_entropy=True)
    assert logp.shape == (0,) and ent.shape == (0,)
    logp.sum().backward()
    assert h.grad.shape == (0, 16)


def test_second_backward_is_refused():
    hidden, weight, labels, _ = _case(seed=4)
    h = hidden.clone().requires_grad_()
    logp, _ = linear_logprobs(h, weight, labels, 50)
    loss = logp.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_shape_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"hidden \(3, 4\) and weight \(5, 6\)"):
        linear_logprobs(torch.zeros(3, 4), torch.zeros(5, 6), torch.zeros(3, dtype=torch.long))


def _fp32_reference(hidden, weight, labels, vocab_size, temperature):
    """log p of the labels and the gradients of sum(coef * logp), all fp32, from the bf16 values cast up: what
    vLLM's head_dtype float32 computes (F.linear of the cast inputs), then log_softmax."""
    h = hidden.float().requires_grad_()
    w = weight.float().requires_grad_()
    logits = (h @ w[:vocab_size].t()) / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return logp, h, w


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_head_in_bf16_is_fp32_maths_of_the_bf16_values(monkeypatch, temperature):
    monkeypatch.setattr(logprob_head, "VOCAB_CHUNK", 64, raising=False)  # several weight chunks, the last one short
    n, h_dim, v_pad, vocab = 29, 64, 300, 290
    g = torch.Generator().manual_seed(5)
    hidden = (torch.randn(n, h_dim, generator=g) * 2).bfloat16()  # logits ~ N(0, 16^2): bf16 steps of 0.06-0.25
    weight = torch.randn(v_pad, h_dim, generator=g).bfloat16()
    labels = torch.randint(0, vocab, (n,), generator=g)
    coef = torch.randn(n, generator=g)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, _ = linear_logprobs(h1, w1, labels, vocab, temperature=temperature)  # the default head: fp32
    ref, h_ref, w_ref = _fp32_reference(hidden, weight, labels, vocab, temperature)
    # a logit is an H-term fp32 dot product; log p adds the V-term sum of the log-softmax (weights p, sum 1)
    logit_mag = (hidden.float().abs() @ weight[:vocab].float().abs().t()).max(-1).values / temperature
    bound = 2 * rounding_bound(h_dim, logit_mag) + rounding_bound(vocab, 1.0)
    assert logp.dtype == torch.float32
    assert ((logp - ref).abs() <= bound).all(), (logp - ref).abs().max()
    (logp * coef).sum().backward()
    (ref * coef).sum().backward()
    assert h1.grad.dtype == torch.bfloat16 and w1.grad.dtype == torch.bfloat16
    assert torch.count_nonzero(w1.grad[vocab:]) == 0  # padded rows get no gradient
    # dL/dz = coef (onehot - p) / T, |dL/dz| summed over v <= 2 |coef| / T; each gradient a V- (N-) term fp32 sum,
    # then rounded once to bf16 (half an ulp, eps_bf16 / 2 relative; both sides round: one eps_bf16)
    dz = (coef.abs() * 2 / temperature).unsqueeze(-1)
    h_bound = rounding_bound(vocab, dz * weight[:vocab].float().abs().max(0).values) \
        + rounding_bound(1, h_ref.grad.abs(), torch.bfloat16)
    w_bound = rounding_bound(n, dz.abs().t() @ hidden.float().abs()) + rounding_bound(1, w_ref.grad[:vocab].abs(),
                                                                                      torch.bfloat16)
    assert ((h1.grad.float() - h_ref.grad).abs() <= h_bound).all()
    assert ((w1.grad[:vocab].float() - w_ref.grad[:vocab]).abs() <= w_bound).all()
    # the model-dtype head rounds the logits to bf16 first: far outside the fp32 head's rounding
    model, _ = linear_logprobs(hidden, weight, labels, vocab, temperature=temperature, head_dtype="model")
    assert (model - ref).abs().max() > 10 * bound.max()


def test_head_dtype_is_checked_and_fp32_inputs_ignore_it():
    hidden, weight, labels, _ = _case(dtype=torch.float32, seed=6)
    a, _ = linear_logprobs(hidden, weight, labels, 50, head_dtype="float32")
    b, _ = linear_logprobs(hidden, weight, labels, 50, head_dtype="model")
    assert torch.equal(a, b)  # one head in fp32: the same kernels on the same data
    with pytest.raises(ValueError, match="trainer.head_dtype 'fp16'; valid: float32, model"):
        linear_logprobs(hidden, weight, labels, 50, head_dtype="fp16")
