"""Failed samples: what their group sees (`rollout.reward.on_failure`), and when a run that cannot learn stops.

A sample fails when its reward raised, timed out or returned a non-number, when its episode's environment
errored, or when the engine aborted it outside partial rollouts (it then has no reward at all). Under "drop" it
leaves its group before the group statistics; under "score" a finished completion stays and gets the configured
failure reward, so outputs that crash the scorer get a negative advantage like any bad output. Unfinished ones
(aborted, interrupted) are always dropped: they say nothing about the output.

`FailureGuard` stops the run (TooManyFailedSamples) when every sample of a step failed, or when the failed share
stayed above `max_failed_share` for `max_failed_steps` steps in a row: training on the survivors would be
biased, and a run that trains nothing must not end as a success. Pure bookkeeping, no Ray.
"""
from __future__ import annotations

from dataclasses import dataclass

from gspo_ray.data.records import Sample

UNFINISHED = ("aborted", "interrupted")  # finish reasons of completions stopped from outside
MAX_REASONS = 20  # distinct failure reasons remembered per step (the message shows the first three)


class TooManyFailedSamples(RuntimeError):
    """The run stopped because too many of its samples failed; the message names the first reasons."""


def mark_unscored(samples: list[Sample]) -> None:
    """A sample with neither a reward nor a failure reason (the engine aborted it outside partial rollouts, so
    it was never scored) becomes a failed one, so nothing downstream meets reward=None."""
    for s in samples:
        if s.failed is None and s.reward is None:
            s.failed = f"no reward: the engine stopped the completion ({s.finish_reason!r}) before it was scored"


@dataclass
class FailurePolicy:
    """`rollout.reward.on_failure` / `failure_reward`, applied to one group's samples before its advantages."""

    on_failure: str = "drop"
    failure_reward: float | None = None

    def apply(self, samples: list[Sample], per_token: bool = False) -> list[Sample]:
        """The samples that enter the group statistics: scorable ones, plus (under "score") finished failed
        ones given the failure reward (per-token runs: all of it on the last model token)."""
        kept = []
        for s in samples:
            if s.failed is not None:
                if self.on_failure != "score" or s.finish_reason in UNFINISHED:
                    s.reward = None
                    continue
                s.reward = float(self.failure_reward)
                if per_token:
                    s.token_rewards = _last_token_reward(s, s.reward)
            if s.reward is not None:
                kept.append(s)
        return kept


def _last_token_reward(s: Sample, reward: float) -> list[float]:
    out = [0.0] * s.num_tokens
    last = max((i for i, m in enumerate(s.loss_mask) if m), default=s.num_tokens - 1)
    if out:
        out[last] = reward
    return out


class FailureGuard:
    """Counts consecutive steps whose failed share is above the limit; raises TooManyFailedSamples."""

    def __init__(self, max_failed_share: float, max_failed_steps: int):
        self.max_share, self.max_steps = max_failed_share, max_failed_steps
        self.streak = 0

    def check(self, step: int, failed: int, total: int, reasons: dict[str, int]) -> None:
        """One step's tally (`reasons`: failure reason -> count, in the order first seen)."""
        if total == 0:
            return
        share = failed / total
        self.streak = self.streak + 1 if share > self.max_share else 0
        if failed < total and self.streak < self.max_steps:
            return
        why = ("every sample failed" if failed == total else
               f"{share:.0%} of {total} samples failed, above rollout.reward.max_failed_share "
               f"({self.max_share:g}) for {self.streak} steps in a row")
        raise TooManyFailedSamples(f"step {step}: {why} ({failed}/{total}); first reasons: "
                                   f"{format_reasons(reasons)}. The run cannot learn: fix the reward function or "
                                   "environment (or raise rollout.reward.max_failed_share)")


def count_reason(reasons: dict[str, int], reason: str) -> None:
    """Tally one failure reason (one line, at most 200 characters; at most MAX_REASONS distinct ones)."""
    reason = " ".join(reason.split())[:200]
    if reason in reasons or len(reasons) < MAX_REASONS:
        reasons[reason] = reasons.get(reason, 0) + 1


def format_reasons(reasons: dict[str, int], first: int = 3) -> str:
    shown = [f"{r!r} x{n}" for r, n in list(reasons.items())[:first]]
    more = len(reasons) - first
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "") if shown else "none recorded"
