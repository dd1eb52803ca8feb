"""The group buffer: whole prompt groups in, advantages computed, uninformative or stale groups out, mini-batches.

The unit is a group (all completions of one prompt): advantages are relative within a group, so a group is
admitted, filtered, split into mini-batches and dropped as a whole. Pure bookkeeping, no Ray.

With `per_token=True` (`algorithm.advantage.per_token`, multi-turn episodes with per-turn rewards) each admitted
group also gets per-token advantages (reward-to-go over its episodes' `token_rewards`, 0 on env tokens), which
`pack_groups` then uses; the zero-variance filter still looks at the sequence rewards.

With a `stale_rule` (partial rollouts: `rollout.partial` stale_policy and max_staleness) each completion is
passed through `apply_stale_policy` at admission, before advantages: "mask" turns off too-old tokens, "drop"
removes the completion (the group's advantages are then over the rest). Groups still waiting in the buffer at
the next step are admitted again under the new version, so the rule always holds for the version that trains.

Failed samples follow a `FailurePolicy` (`rollout.reward.on_failure`, see coordinator/failures.py): dropped
before the group statistics, or kept with the failure reward. A sample that reaches the buffer unscored (the
engine aborted it outside partial rollouts) counts as failed.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from gspo_ray.algo.advantages import compute_ragged_token_advantages
from gspo_ray.algo.robust_advantages import compute_robust_group_advantages
from gspo_ray.coordinator.failures import FailurePolicy, count_reason, mark_unscored
from gspo_ray.data.records import Group, TrainBatch, collate
from gspo_ray.rollout.partial import filter_stale


@dataclass
class AdmitStats:
    """What happened to the groups offered to the buffer in one rollout round."""

    offered: int = 0
    admitted: int = 0
    zero_adv: int = 0  # all rewards equal: no learning signal
    stale: int = 0  # older than max_staleness policy versions
    failed: int = 0  # fewer than 2 scorable samples
    failed_samples: int = 0
    samples: int = 0  # samples offered (the failed share's denominator)
    failure_reasons: dict[str, int] = field(default_factory=dict)  # reason -> count, first seen first
    stale_dropped_samples: int = 0  # stale_rule "drop"
    stale_masked_tokens: int = 0  # stale_rule "mask"
    rewards: list[float] = field(default_factory=list)

    def merge(self, other: "AdmitStats") -> None:
        for k in ("offered", "admitted", "zero_adv", "stale", "failed", "failed_samples", "samples",
                  "stale_dropped_samples", "stale_masked_tokens"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.rewards += other.rewards
        for reason, n in other.failure_reasons.items():
            count_reason(self.failure_reasons, reason, n)


def group_advantages(group: Group, scale_by_std: bool, eps: float,
                     robust: tuple[str, float] = ("none", 0.1)) -> tuple[list[float], bool]:
    """Advantages of the group's samples that carry a reward (apply the FailurePolicy first: failed ones have
    none under "drop"). robust: (advantage.robust, advantage.clip_quantile). Returns (advantages, zero_variance)."""
    rewards = torch.tensor([s.reward for s in group.samples if s.reward is not None], dtype=torch.float64)
    if rewards.numel() < 2:
        return [], True
    adv, zero_var = compute_robust_group_advantages(rewards[None, :], robust[0], scale_by_std, eps, robust[1])
    return adv[0].tolist(), bool(zero_var[0])


class GroupBuffer:
    """Admits scored groups for training; hands out mini-batches of whole groups."""

    def __init__(self, *, scale_by_std: bool = True, adv_eps: float = 1e-4, filter_zero_adv: bool = True,
                 max_staleness: int | None = None, seed: int = 0, per_token: bool = False,
                 stale_rule: tuple[str, int] | None = None, token_baseline: str = "turn",
                 failure: FailurePolicy | None = None, robust: tuple[str, float] = ("none", 0.1)):
        """per_token: also compute per-token advantages from the samples' `token_rewards` (needs them set).
        max_staleness: drop whole groups older than this many versions (async mode). stale_rule: (stale_policy,
        max_staleness) applied per completion (partial rollouts, see module doc). failure: what failed samples
        become (default: dropped)."""
        self.scale_by_std = scale_by_std
        self.per_token = per_token
        self.adv_eps = adv_eps
        self.filter_zero_adv = filter_zero_adv
        self.max_staleness = max_staleness
        self.stale_rule = stale_rule
        self.token_baseline = token_baseline  # per_token: "turn" or "group" (algorithm.advantage.token_baseline)
        self.failure = failure or FailurePolicy()
        self.robust = robust  # (algorithm.advantage.robust, clip_quantile)
        self.groups: list[Group] = []
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self.groups)

    def rng_state(self) -> list:
        """The mini-batch shuffle's RNG state, JSON-able (a checkpoint carries it: a resumed run deals the same
        groups into the same mini-batches as the uninterrupted one)."""
        version, internal, gauss = self._rng.getstate()
        return [version, list(internal), gauss]

    def load_rng_state(self, state: list) -> None:
        version, internal, gauss = state
        self._rng.setstate((version, tuple(internal), gauss))

    def admit(self, groups: list[Group], current_version: int) -> AdmitStats:
        """Compute advantages and keep the informative, fresh groups. Failed samples follow the FailurePolicy."""
        stats = AdmitStats(offered=len(groups))
        for g in groups:
            mark_unscored(g.samples)
            stats.samples += len(g.samples)
            for s in g.samples:
                if s.failed is not None:
                    stats.failed_samples += 1
                    count_reason(stats.failure_reasons, s.failed)
            stats.rewards += [s.reward for s in g.samples if s.failed is None]
            if self.max_staleness is not None and current_version - g.version_span()[0] > self.max_staleness:
                stats.stale += 1
                continue
            if self.stale_rule is not None:
                kept, st = filter_stale(g.samples, current_version, *self.stale_rule)
                stats.stale_dropped_samples += st.dropped_samples
                stats.stale_masked_tokens += st.masked_tokens
                g.samples = kept
            g.samples = self.failure.apply(g.samples, per_token=self.per_token)
            adv, zero_var = group_advantages(g, self.scale_by_std, self.adv_eps, self.robust)
            if not adv:
                stats.failed += 1
                continue
            if zero_var and self.filter_zero_adv:
                stats.zero_adv += 1
                continue
            g.advantages = adv  # per completion; also what rollout dumps show
            if self.per_token:
                g.token_advantages = self._token_advantages(g)
            self.groups.append(g)
            stats.admitted += 1
        return stats

    def _token_advantages(self, g: Group) -> list[list[float]]:
        missing = [f"{s.prompt_uid}/{s.sample_index}" for s in g.samples if s.token_rewards is None]
        if missing:
            raise ValueError(f"algorithm.advantage.per_token is set but samples {missing[:3]} carry no token_rewards: "
                             "use rollout.multi_turn episodes or a reward function that returns 'token_rewards'")
        return compute_ragged_token_advantages([s.token_rewards for s in g.samples], [s.loss_mask for s in g.samples],
                                               [s.prompt_uid for s in g.samples], self.scale_by_std, self.adv_eps,
                                               self.token_baseline,
                                               turn_starts=[s.turn_starts for s in g.samples])

    def take(self, num_groups: int) -> list[Group]:
        """Remove and return the oldest `num_groups` groups (fewer if the buffer holds fewer)."""
        out, self.groups = self.groups[:num_groups], self.groups[num_groups:]
        return out

    def drop_stale(self, current_version: int) -> int:
        """Drop buffered groups that became too old while waiting; returns how many. With a stale_rule the
        waiting groups are admitted again under `current_version` (their rule re-applied, advantages redone)."""
        if self.stale_rule is not None:
            waiting, self.groups = self.groups, []
            return len(waiting) - self.admit(waiting, current_version).admitted
        if self.max_staleness is None:
            return 0
        keep = [g for g in self.groups if current_version - g.version_span()[0] <= self.max_staleness]
        dropped = len(self.groups) - len(keep)
        self.groups = keep
        return dropped

    def minibatches(self, groups: list[Group], num_minibatches: int, shuffle: bool = True) -> list[TrainBatch]:
        """Split whole groups into `num_minibatches` padded TrainBatches (group order shuffled per pass)."""
        order = list(range(len(groups)))
        if shuffle:
            self._rng.shuffle(order)
        per = len(order) // num_minibatches
        if per == 0:
            raise ValueError(f"{len(groups)} groups cannot fill {num_minibatches} mini-batches")
        batches = []
        for m in range(num_minibatches):
            idx = order[m * per:(m + 1) * per] if m < num_minibatches - 1 else order[m * per:]
            batches.append(pack_groups([groups[i] for i in idx]))
        return batches


def pack_groups(groups: list[Group]) -> TrainBatch:
    """Whole groups -> one TrainBatch; each completion's advantage is shared by its tokens (or per-token ones)."""
    samples, advs = [], []
    for g in groups:
        for i, s in enumerate(g.samples):
            samples.append(s)
            if g.token_advantages is not None:
                advs.append(g.token_advantages[i])
            else:
                advs.append([g.advantages[i]] * s.num_tokens)
    return collate(samples, advs)
