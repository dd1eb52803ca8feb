"""Failed samples: what their group sees (`rollout.reward.on_failure`), and when a run that cannot learn stops.

A sample fails when its reward raised, timed out or returned a non-number, when its episode's environment
errored, or when the engine aborted it outside partial rollouts (it then has no reward at all). Under "drop" it
leaves its group before the group statistics; under "score" a finished completion stays and gets the configured
failure reward, so outputs that crash the scorer get a negative advantage like any bad output. Unfinished ones
(aborted, interrupted) are always dropped: they say nothing about the output.

`FailureGuard` stops the run (TooManyFailedSamples) when every sample of a step failed, or when the failed share
stayed above `max_failed_share` for `max_failed_steps` steps in a row: training on the survivors would be
biased, and a run that trains nothing must not end as a success. A run shorter than `max_failed_steps` whose
every step was above the share fails too, at its end (`check_end`). Pure bookkeeping, no Ray.

Reasons are grouped by what raised and where, not by their text: `reward raised TypeError at my_reward.py:12:
...` counts under "reward raised TypeError at my_reward.py:12" whatever the message says (a message that embeds
a length or a value would otherwise make one bug many groups); a reason without a raising frame is grouped with
its numbers masked. The first message of each group is the one shown.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from gspo_ray.data.records import Sample

UNFINISHED = ("aborted", "interrupted")  # finish reasons of completions stopped from outside
MAX_REASONS = 20  # distinct failure reason groups remembered per step (the message shows the first three)
_SITE = re.compile(r"^(.*? raised [\w.]+ at \S+:\d+)(?=:|$)")  # "... raised Type at file.py:12", see scoring


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
        self.steps = self.steps_over = 0  # steps checked, and how many of them were above the share
        self.last_reasons: dict[str, int] = {}

    def check(self, step: int, failed: int, total: int, reasons: dict[str, int]) -> None:
        """One step's tally (`reasons`: failure reason -> count, in the order first seen)."""
        if total == 0:
            return
        share = failed / total
        self.streak = self.streak + 1 if share > self.max_share else 0
        self.steps += 1
        self.steps_over += share > self.max_share
        self.last_reasons = dict(reasons) if failed else self.last_reasons
        if failed < total and self.streak < self.max_steps:
            return
        why = ("every sample failed" if failed == total else
               f"{share:.0%} of {total} samples failed, above rollout.reward.max_failed_share "
               f"({self.max_share:g}) for {self.streak} steps in a row")
        raise TooManyFailedSamples(f"step {step}: {why} ({failed}/{total}); first reasons: "
                                   f"{format_reasons(reasons)}. The run cannot learn: fix the reward function or "
                                   "environment (or raise rollout.reward.max_failed_share)")

    def state_dict(self) -> dict:
        """The streak and tallies: a resumed run stops at the same step as the uninterrupted one."""
        return {"streak": self.streak, "steps": self.steps, "steps_over": self.steps_over,
                "last_reasons": dict(self.last_reasons)}

    def load_state_dict(self, state: dict) -> None:
        self.streak, self.steps, self.steps_over = int(state["streak"]), int(state["steps"]), int(state["steps_over"])
        self.last_reasons = dict(state.get("last_reasons", {}))

    def check_end(self) -> None:
        """At the end of a run: every step it ran was above the share (too few steps for the streak rule)."""
        if self.steps and self.steps_over == self.steps:
            raise TooManyFailedSamples(
                f"every one of the run's {self.steps} step(s) had more than rollout.reward.max_failed_share "
                f"({self.max_share:g}) of its samples failed; last reasons: {format_reasons(self.last_reasons)}. "
                "The run did not learn: fix the reward function or environment")


def reason_group(reason: str) -> str:
    """What a failure reason is counted under: its exception type and raising frame when it names them, else
    its text with numbers masked."""
    m = _SITE.match(reason)
    return m.group(1) if m else re.sub(r"\d+(\.\d+)?", "#", reason)


def count_reason(reasons: dict[str, int], reason: str, n: int = 1) -> None:
    """Tally one failure reason (one line, at most 200 characters) under its group (`reason_group`), keyed by
    the group's first message; at most MAX_REASONS groups. `n`: how many times it occurred."""
    reason = " ".join(reason.split())[:200]
    group = reason_group(reason)
    key = next((r for r in reasons if reason_group(r) == group), reason)
    if key in reasons or len(reasons) < MAX_REASONS:
        reasons[key] = reasons.get(key, 0) + n


def failure_line(step: int, failed: int, total: int, reasons: dict[str, int]) -> str | None:
    """The console line of a step whose samples failed (None when none did): the share and the first reason."""
    if not failed:
        return None
    return (f"step {step}: {failed}/{total} samples failed ({failed / max(total, 1):.0%}): "
            f"{format_reasons(reasons, first=1)}")


def format_reasons(reasons: dict[str, int], first: int = 3) -> str:
    shown = [f"{r!r} x{n}" for r, n in list(reasons.items())[:first]]
    more = len(reasons) - first
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "") if shown else "none recorded"
