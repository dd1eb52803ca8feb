"""The gated delta rule, chunked, with the recurrent state passed in and out.

Per value head, with a state S of [Dk, Dv] (0 at a sequence's first token unless an initial state is given), a
token t with query q_t, key k_t (both L2-normalised), value v_t, log decay g_t <= 0 and write strength beta_t:

    S'  = exp(g_t) S_{t-1}
    S_t = S' + k_t beta_t (v_t - S'^T k_t)^T          (the delta rule: write the part of v_t that S' does not predict)
    o_t = S_t^T q_t / sqrt(Dk)

Chunked form (chunks of C tokens; Yang et al., "Gated Delta Networks"; the same algebra as transformers'
torch_chunk_gated_delta_rule and flash-linear-attention's kernels): inside a chunk, with gamma_i the cumulative log
decay from the chunk start, the UT transform T = (I + tril_-1(beta_i k_i . k_j exp(gamma_i - gamma_j)))^-1 turns the
C sequential updates into matmuls: u = T (beta v) (new values), w = T (beta k exp(gamma)) (keys reading the entry
state); then per chunk, in order,

    v_new = u - w S ;  o = (q exp(gamma)) S + (q k^T * D) v_new ;  S = exp(gamma_C) S + (k exp(gamma_C - gamma))^T v_new

with D_ij = exp(gamma_i - gamma_j) for j <= i, 0 above. The chunk size only regroups the same sums, so two runs that
cut a sequence at different chunk boundaries agree up to rounding (fp32: ~1e-6 relative; fp64: ~1e-14).

    out, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None)   # one sequence, [T, H, D] inputs
    outs = run_sequences(pieces, initial_states)     # many sequences: torch per sequence, or one fla call on CUDA

Computed in fp32 at least (fp64 inputs stay fp64), cast back to the value dtype, as transformers' copy does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64  # transformers' and flash-linear-attention's default chunk


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension, in fp32 at least (flash-linear-attention's l2norm)."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(query: Tensor, key: Tensor, value: Tensor, log_decay: Tensor, beta: Tensor,
                           initial_state: Tensor | None = None, chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """One sequence: query / key [T, H, Dk] (L2-normalised, H value heads: GQA repeated already), value
    [T, H, Dv], log_decay / beta [T, H], initial_state [H, Dk, Dv] or None (zero) -> (output [T, H, Dv] in value's
    dtype, final state [H, Dk, Dv] in the compute dtype). The module docstring gives the formula."""
    dtype = torch.promote_types(value.dtype, torch.float32)
    length, heads, key_dim = key.shape
    value_dim = value.shape[-1]
    state = (initial_state.to(dtype) if initial_state is not None
             else value.new_zeros(heads, key_dim, value_dim, dtype=dtype))
    if length == 0:
        return value.new_zeros(0, heads, value_dim), state
    pad = (-length) % chunk
    # [H, n, C, D] / [H, n, C]; padded tokens have k = v = beta = 0 and g = 0: they change neither outputs nor state
    q, k, v = (F.pad(x.transpose(0, 1).to(dtype), (0, 0, 0, pad)).unflatten(1, (-1, chunk))
               for x in (query * key_dim ** -0.5, key, value))
    b, g = (F.pad(x.transpose(0, 1).to(dtype), (0, pad)).unflatten(1, (-1, chunk)) for x in (beta, log_decay))
    gamma = g.cumsum(-1)
    above = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(above, float("-inf")).exp()  # D
    k_beta = k * b[..., None]
    system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)  # unit lower triangular system I + system
    u = torch.linalg.solve_triangular(system, v * b[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True)
    inner = q @ k.transpose(-1, -2) * decay
    q_in = q * gamma.exp()[..., None]
    k_out = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    outs = []
    for i in range(q.shape[1]):
        v_new = u[:, i] - w[:, i] @ state
        outs.append(q_in[:, i] @ state + inner[:, i] @ v_new)
        state = state * chunk_decay[:, i] + k_out[:, i].transpose(-1, -2) @ v_new
    out = torch.cat(outs, dim=1)[:, :length].transpose(0, 1)
    return out.to(value.dtype), state


def fla_available(device: torch.device) -> bool:
    """flash-linear-attention's kernels run here: a CUDA device and the package importable."""
    if device.type != "cuda":
        return False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def run_sequences(pieces: list[tuple[Tensor, ...]], initial_states: list[Tensor | None]) -> list[tuple[Tensor, Tensor]]:
    """Many sequences, each (query, key, value, log_decay, beta) as chunk_gated_delta_rule takes them, and each its
    initial state (None: zero) -> [(output, final state)] in order. On CUDA with flash-linear-attention: one
    varlen call of its `chunk_gated_delta_rule` over them all (run_varlen). Elsewhere: the torch rule per
    sequence."""
    if not pieces:
        return []
    if any(p[0].shape[0] == 0 for p in pieces):  # empty sequences: their state passes through (no kernel call)
        ran = iter(run_sequences([p for p in pieces if p[0].shape[0]],
                                 [s for p, s in zip(pieces, initial_states) if p[0].shape[0]]))
        return [next(ran) if p[0].shape[0] else chunk_gated_delta_rule(*p, initial_state=s)
                for p, s in zip(pieces, initial_states)]
    if not fla_available(pieces[0][0].device):
        return [chunk_gated_delta_rule(*p, initial_state=s) for p, s in zip(pieces, initial_states)]
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

    return run_varlen(pieces, initial_states, fla_chunk_gated_delta_rule)


def run_varlen(pieces: list[tuple[Tensor, ...]], initial_states: list[Tensor | None],
               kernel) -> list[tuple[Tensor, Tensor]]:
    """Non-empty sequences through one call of a kernel with flash-linear-attention's varlen API
    (`kernel(q, k, v, g, beta, initial_state=[N, H, Dk, Dv], output_final_state=True, cu_seqlens=[N + 1])`, inputs
    [1, sum T, H, D]: the sequences concatenated, no state crossing a boundary; the scale its default 1 / sqrt(Dk)):
    cu_seqlens at the boundaries, the initial states stacked (zero where None), the outputs split back."""
    q, k, v, g, b = (torch.cat([p[i] for p in pieces])[None] for i in range(5))
    q, k = q.to(v.dtype), k.to(v.dtype)  # the kernels take q / k / v of one dtype (l2norm returned fp32)
    heads, key_dim, value_dim = k.shape[2], k.shape[3], v.shape[3]
    lengths = [p[0].shape[0] for p in pieces]
    cu_seqlens = torch.tensor([0] + lengths, device=q.device).cumsum(0)
    zero = q.new_zeros(heads, key_dim, value_dim, dtype=torch.float32)
    h0 = torch.stack([s.float() if s is not None else zero for s in initial_states])
    out, final = kernel(q, k, v, g.float(), b, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    return list(zip(out[0].split(lengths), final.unbind(0)))
