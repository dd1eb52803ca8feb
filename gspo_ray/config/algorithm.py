"""The algorithm: importance-sampling level, clip band (fixed or auto), advantages, KL, aggregation,
mismatch corrections."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gspo_ray.config.base import Strict, ImportanceLevel, Aggregation, DEFAULT_CLIP


class AdvantageConfig(Strict):
    """Group-relative advantages: A_i = (R_i - mean_group R) / (std_group(R, ddof=1) + eps)."""

    scale_by_std: bool = Field(True, description="divide by the group std (False = Dr.GRPO)")
    eps: float = Field(1e-4, gt=0, description="added to the std")
    per_token: bool = Field(False, description="per-token advantages (process rewards); needs sequence_token")
    token_baseline: Literal["turn", "group"] = Field(
        "turn", description="per-token advantages: reward-to-go compared with the same turn of the group's other "
        "episodes (turn), or with every token of the group (group: biased when turns cost something)")
    robust: Literal["none", "clip", "rank"] = Field(
        "none", description="outlier-robust group advantages: none = plain formula; clip = winsorise rewards at the "
        "group's clip_quantile / 1 - clip_quantile (a lone outlier takes its neighbour's reward); rank = use the "
        "rewards' ranks within the group (see gspo_ray/algo/robust_advantages.py)")
    clip_quantile: float = Field(0.1, ge=0, lt=0.5, description="robust=clip: quantile of the low bound (the high "
                                 "one is 1 - q), rounded inwards to an observed reward")


class AutoEpsConfig(Strict):
    """`algorithm.eps: auto`: eps_low = k * sigma / sqrt(L), k moved so the sequence clip fraction of reuse
    mini-batches tracks a target (gspo_ray/algo/auto_eps.py); eps_high = 4/3 eps_low."""

    target_clip_frac: float = Field(0.15, gt=0, lt=1, description="sequence clip fraction to track on reuse "
                                    "mini-batches; 0.15 = the GSPO paper's measured clipped-token fraction (Fig. 4, "
                                    "3e-4/4e-4, 4 mini-batches per rollout batch)")
    min_eps: float = Field(1e-5, gt=0, description="lower bound of eps_low")
    max_eps: float = Field(0.2, gt=0, description="upper bound of eps_low (0.2 = GRPO's token band)")
    gain: float = Field(0.5, gt=0, description="feedback step: k *= exp(gain * (clip - target) / target)")
    max_step: float = Field(2.0, gt=1, description="largest factor k may change by in one update")

    @model_validator(mode="after")
    def _check(self) -> "AutoEpsConfig":
        if self.min_eps > self.max_eps:
            raise ValueError(f"algorithm.auto_eps.min_eps ({self.min_eps}) > max_eps ({self.max_eps})")
        if self.max_eps >= 1:  # the band is [1 - eps_low, 1 + eps_high]: eps_low >= 1 puts log(1 - eps) out of range
            raise ValueError(f"algorithm.auto_eps.max_eps ({self.max_eps}) must be < 1: it bounds eps_low, and "
                             "the clip band's lower edge 1 - eps_low must stay above 0")
        return self


class MismatchCorrectionConfig(Strict):
    """Engine-vs-trainer mismatch correction (TIS / MIS / IcePop) when `coordinator.recompute_old_logprobs`:
    the trainer's recomputed log-probs anchor the ratio and rho = pi_old / pi_engine, truncated or masked,
    weights each token's policy-gradient term (gspo_ray/algo/mismatch_correction.py)."""

    level: Literal["none", "token", "sequence", "geometric"] = Field(
        "none", description="rho per token, per completion (product), or per completion (geometric mean); none = off")
    mode: Literal["truncate", "mask"] = Field("truncate", description="truncate: w = min(rho, upper) (TIS); mask: "
                                              "w = rho inside [lower, upper], else 0 (MIS / IcePop)")
    lower: float = Field(0.5, ge=0, lt=1, description="mask: smallest rho kept")
    upper: float = Field(2.0, gt=1, description="truncate: cap of rho; mask: largest rho kept")


class AlgorithmConfig(Strict):
    """The policy objective. Defaults are GSPO's."""

    importance_sampling_level: ImportanceLevel = Field(
        "sequence", description="token = GRPO, sequence = GSPO, sequence_token = GSPO-token")
    eps_low: float | None = Field(None, gt=0, description="lower clip (default by level: 3e-4 seq, 0.2 token)")
    eps_high: float | None = Field(None, gt=0, description="upper clip (default by level: 4e-4 seq, 0.27 token)")
    dual_clip_c: float | None = Field(None, gt=1, description="dual-clip bound for negative advantages (off)")
    aggregation: Aggregation = Field("seq-mean-token-mean", description="how token losses are averaged")
    norm_len: int | None = Field(None, gt=0, description="constant length for seq-mean-token-sum-norm; default "
                                 "the completion limit (rollout.max_new_tokens, multi_turn.max_total_tokens)")
    beta: float = Field(0.0, ge=0, description="KL coefficient to the reference policy (0 = no reference)")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="advantage estimation")
    eps: Literal["fixed", "auto"] = Field("fixed", description="fixed: eps_low/eps_high as set; auto (sequence "
                                          "levels): the band follows the measured drift, see auto_eps")
    auto_eps: AutoEpsConfig = Field(default_factory=AutoEpsConfig, description="settings of eps: auto")
    dilution_threshold: float = Field(0.2, gt=0, description="|log r_t| above which a token of an unclipped "
                                      "completion counts as diluted (train/dilution_frac); 0.2 ~ GRPO's token band")
    dilution_mask: Literal["none", "token", "sequence"] = Field(
        "none", description="drop diluted tokens (token) or completions holding one (sequence) from the "
        "policy-gradient term; sequence levels only")
    mismatch_correction: MismatchCorrectionConfig = Field(
        default_factory=MismatchCorrectionConfig, description="TIS / MIS correction (needs recompute_old_logprobs)")

    @model_validator(mode="after")
    def _check_new_options(self) -> "AlgorithmConfig":
        level = self.importance_sampling_level
        if self.eps == "auto" and level == "token":
            raise ValueError("algorithm.eps 'auto' sets the sequence-level band (eps ~ k * sigma / sqrt(L)); with "
                             "importance_sampling_level 'token' set eps_low/eps_high instead")
        if self.dilution_mask != "none" and level == "token":
            raise ValueError("algorithm.dilution_mask needs a sequence level: at 'token' each token is clipped on "
                             "its own, nothing is diluted")
        if self.advantage.robust != "none" and self.advantage.per_token:
            raise ValueError("algorithm.advantage.robust applies to one reward per completion; it cannot be "
                             "combined with advantage.per_token")
        mc = self.mismatch_correction
        if level == "sequence" and mc.level == "token" and mc.mode == "truncate":
            # every token of a completion shares one gradient direction through s, so per-token weights only
            # rescale the completion by mean_t min(rho_t, upper): an arithmetic mean no correction is defined by
            raise ValueError("algorithm.mismatch_correction.level 'token' with mode 'truncate' (token TIS) under "
                             "importance_sampling_level 'sequence' (GSPO) only weighs each completion by the "
                             "mean of its truncated token ratios: use mismatch_correction.level 'geometric' (the "
                             "length-normalised ratio, like GSPO's s) or 'sequence', or importance_sampling_level "
                             "'sequence_token', where each token keeps its own weight")
        return self

    @model_validator(mode="after")
    def _check(self) -> "AlgorithmConfig":
        level, agg = self.importance_sampling_level, self.aggregation
        if level == "sequence" and agg != "seq-mean-token-mean":
            raise ValueError(f"algorithm.aggregation {agg!r} weights completions by length, which breaks GSPO's "
                             "sequence-level objective (importance_sampling_level='sequence'); "
                             "use 'seq-mean-token-mean'")
        if self.advantage.per_token and level == "sequence":
            raise ValueError("algorithm.advantage.per_token needs importance_sampling_level='sequence_token': "
                             "'sequence' averages per-token advantages away")
        lo, hi = self.clip_range()
        if lo >= 1:
            raise ValueError(f"algorithm.eps_low must be < 1 (got {lo})")
        return self

    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high) with level defaults filled in."""
        lo, hi = DEFAULT_CLIP[self.importance_sampling_level]
        return (self.eps_low if self.eps_low is not None else lo, self.eps_high if self.eps_high is not None else hi)
