"""Staleness rules for partial rollouts: what to do with tokens sampled by an older policy. Pure; no engine.

    sample = apply_stale_policy(sample, current_version=7, policy="mask", max_staleness=1)   # Sample | None
    kept, stats = filter_stale(samples, current_version=7, policy="drop", max_staleness=1)
    if group_ready(group_samples): ...                                                       # no "aborted" left

A partial rollout generates a completion in budgeted segments (`RolloutEngine.generate(budget=...)`, then
`continue_samples`); weights may be pushed between segments, so one completion can carry tokens of several
policy versions (`Sample.versions[t]`, stamped at dispatch). A token's staleness is `current - versions[t]`;
it is too old when that exceeds `max_staleness`. Policies (`PartialRolloutConfig.stale_policy`):
- keep: train every token (the engine log-prob of an old token is still the right old-policy anchor).
- mask: loss_mask 0 on too-old tokens (they stay in the context; the reward and the other tokens still count).
  A sample whose tokens are all masked is kept: it still counts towards its group's reward statistics, and the
  loss aggregation leaves completions without trainable tokens out.
- drop: discard the whole sample (None) when any trainable token is too old.
Only trainable tokens (loss_mask 1) decide a drop; environment tokens of multi-turn episodes never train.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gspo_ray.data.records import FINISH_ABORTED, Sample

STALE_POLICIES = ("keep", "mask", "drop")


@dataclass
class StaleStats:
    """What `filter_stale` did to one batch of samples."""

    num_samples: int = 0
    dropped_samples: int = 0
    masked_tokens: int = 0  # trainable tokens turned off by "mask"
    max_staleness: int = 0  # the oldest trainable token seen, in versions behind the current one


def check_stale_policy(policy: str, max_staleness: int) -> None:
    """Raise ValueError naming the valid policies, or when max_staleness is negative."""
    if policy not in STALE_POLICIES:
        raise ValueError(f"unknown stale_policy {policy!r}; valid: {', '.join(STALE_POLICIES)}")
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")


def compute_token_staleness(versions: list[int], current_version: int) -> list[int]:
    """current - version per token: [T]; a token newer than the current version is a bookkeeping bug."""
    if versions and max(versions) > current_version:
        raise ValueError(f"token version {max(versions)} is newer than the current version {current_version}")
    return [current_version - v for v in versions]


def compute_sample_staleness(sample: Sample, current_version: int) -> int:
    """Staleness of the oldest trainable token (0 when nothing trains)."""
    ages = compute_token_staleness(sample.versions, current_version)
    return max((a for a, m in zip(ages, sample.loss_mask) if m), default=0)


def apply_stale_policy(sample: Sample, current_version: int, policy: str, max_staleness: int) -> Sample | None:
    """The sample as it should train now: unchanged (keep), too-old tokens masked (mask, a new Sample), or None
    (drop, when any trainable token is older than `max_staleness`). Never modifies `sample`."""
    check_stale_policy(policy, max_staleness)
    ages = compute_token_staleness(sample.versions, current_version)
    too_old = [a > max_staleness and m == 1 for a, m in zip(ages, sample.loss_mask)]
    if policy == "keep" or not any(too_old):
        return sample
    if policy == "drop":
        return None
    mask = [0 if old else m for old, m in zip(too_old, sample.loss_mask)]
    return dataclasses.replace(sample, loss_mask=mask)


def filter_stale(samples: list[Sample], current_version: int, policy: str,
                 max_staleness: int) -> tuple[list[Sample], StaleStats]:
    """`apply_stale_policy` over a batch; dropped samples are left out. Returns (samples, stats)."""
    stats = StaleStats(num_samples=len(samples))
    out = []
    for s in samples:
        stats.max_staleness = max(stats.max_staleness, compute_sample_staleness(s, current_version))
        new = apply_stale_policy(s, current_version, policy, max_staleness)
        if new is None:
            stats.dropped_samples += 1
            continue
        stats.masked_tokens += sum(s.loss_mask) - sum(new.loss_mask)
        out.append(new)
    return out, stats


def group_ready(group_samples: list[Sample]) -> bool:
    """A group can be scored and trained once it has members and none is still "aborted" (resumable)."""
    return bool(group_samples) and all(s.finish_reason != FINISH_ABORTED for s in group_samples)
