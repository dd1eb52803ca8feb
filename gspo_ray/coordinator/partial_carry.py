"""Partial-rollout carry-over: groups whose completions are not all finished wait here between rollout rounds.

    carry = PartialCarry(cfg.rollout.partial)
    work, stats = carry.take_open(current_version)    # [(prompt, samples, budget)] to continue this round
    ready = carry.absorb(groups_back_from_rollout)     # finished groups out; unfinished ones kept for later

A round gives each unfinished completion at most `segment_tokens` new tokens; a group on its last allowed
segment (`max_segments`) runs without a budget, so every group leaves within `max_segments` rounds. Only whole
groups leave (`group_ready`): advantages are relative within a group, so they wait for its slowest completion.
Under stale_policy "drop", a completion whose trainable tokens are already too old is dropped before it costs
another segment (tokens only age, so it would be dropped at admission anyway). Pure bookkeeping, no Ray.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gspo_ray.data.records import Group, Prompt, Sample
from gspo_ray.rollout.partial import StaleStats, filter_stale, group_ready


@dataclass
class OpenGroup:
    """A prompt whose completions are not all finished yet (finished members wait with their rewards)."""

    prompt: Prompt
    samples: list[Sample]

    @property
    def segments(self) -> int:
        """Rounds this group has been through (its most-continued completion's segment count)."""
        return max((s.segments for s in self.samples), default=0)


class PartialCarry:
    """Unfinished groups between rollout rounds (see module doc). `cfg`: a PartialRolloutConfig."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.open: dict[str, OpenGroup] = {}

    def __len__(self) -> int:
        return len(self.open)

    def budget_for(self, segments_done: int) -> int | None:
        """Token budget of the next segment: the configured one, or None (run to the end) for the last one."""
        return None if segments_done + 1 >= self.cfg.max_segments else self.cfg.segment_tokens

    def take_open(self, current_version: int) -> tuple[list[tuple[Prompt, list[Sample], int | None]], StaleStats]:
        """Remove and return every open group as (prompt, samples, budget) to continue now. Under "drop",
        too-stale completions are discarded first; a group left with fewer than 2 completions is discarded."""
        work, stats = [], StaleStats()
        for group in self.open.values():
            samples = group.samples
            if self.cfg.stale_policy == "drop":
                samples, st = filter_stale(samples, current_version, "drop", self.cfg.max_staleness)
                stats.num_samples += st.num_samples
                stats.dropped_samples += st.dropped_samples
                stats.max_staleness = max(stats.max_staleness, st.max_staleness)
                if len(samples) < 2:
                    stats.dropped_samples += len(samples)
                    continue
            work.append((group.prompt, samples, self.budget_for(group.segments)))
        self.open = {}
        return work, stats

    def absorb(self, groups: list[Group]) -> list[Group]:
        """Keep groups with unfinished completions; return the finished ones (in the given order)."""
        ready = []
        for g in groups:
            if group_ready(g.samples):
                ready.append(g)
            else:
                self.open[g.uid] = OpenGroup(prompt=g.prompt, samples=list(g.samples))
        return ready

    def metrics(self) -> dict[str, float]:
        return {"rollout/partial_open_groups": float(len(self.open)),
                "rollout/partial_open_tokens": float(sum(s.num_tokens for g in self.open.values()
                                                         for s in g.samples))}

    # -- checkpoints (JSON) -----------------------------------------------------------------------------------
    def state_dict(self) -> list[dict]:
        return [group_to_dict(g.prompt, g.samples) for g in self.open.values()]

    def load_state_dict(self, state: list[dict]) -> None:
        self.open = {}
        for item in state:
            prompt, samples = group_from_dict(item)
            self.open[prompt.uid] = OpenGroup(prompt=prompt, samples=samples)


def group_to_dict(prompt: Prompt, samples: list[Sample]) -> dict:
    """A prompt and its samples as JSON-ready dicts (checkpoints)."""
    return {"prompt": dataclasses.asdict(prompt), "samples": [dataclasses.asdict(s) for s in samples]}


def group_from_dict(item: dict) -> tuple[Prompt, list[Sample]]:
    return Prompt(**item["prompt"]), [Sample(**s) for s in item["samples"]]
