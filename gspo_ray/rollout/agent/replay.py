"""A resumed agent episode's recorded turns, answered from the record until the agent diverges.

    record = ReplayRecord.from_sample(carried_sample)    # an unfinished episode's sample, e.g. from a checkpoint
    hit = record.match(plan.context)                      # ReplayHit, or None: the agent asked something else

A rollout worker that is asked to continue an agent episode it does not hold (its worker died, or the job resumed
from a checkpoint) starts the agent again on the same task. The agent is code: given the same replies it sends the
same calls. So each call whose context is a prefix of the record, ending where a recorded model reply starts, is
answered with that reply (its ids, engine log-probs and policy versions as recorded; no engine work). The record's
last reply may be unfinished (the call was cut by a partial-rollout budget): it is answered with the recorded part
continued by the engine. The first call that does not match (an agent that is not deterministic, a history split
before the record's sample) ends the replay: it and the rest of the episode are sampled anew, under the current
policy, as any call. Only the record's last sample (the part after its last history split) is kept in a `Sample`,
so an episode that split before the record is sampled anew from its first call.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReplayHit:
    """A call answered from the record: the recorded reply, and whether it was the whole reply (False: the record
    ends inside it, the engine continues it)."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    rendered_version: int | None  # the version recorded on the call's rendered tokens (None: it has none)
    complete: bool


@dataclass
class ReplayRecord:
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    mask: list[int]
    versions: list[int]
    turn_starts: list[int]

    @classmethod
    def from_sample(cls, s) -> "ReplayRecord":
        """From a `Sample` of an agent episode (prompt ids, then model tokens mask 1 and rendered tokens mask 0)."""
        return cls(list(s.prompt_ids), list(s.completion_ids), list(s.logprobs), list(s.loss_mask),
                   list(s.versions), list(s.turn_starts or []))

    def match(self, context: list[int]) -> ReplayHit | None:
        """The recorded reply to a call whose engine context is `context`, or None when the record has none: the
        context is not a prefix of the record, or ends inside rendered tokens rather than where a reply starts."""
        full = self.prompt_ids + self.ids
        p = len(self.prompt_ids)
        if not p <= len(context) <= len(full) or full[:len(context)] != list(context):
            return None
        pos = len(context) - p
        if pos < len(self.ids) and (self.mask[pos] != 1 or pos not in self.turn_starts):
            return None
        later = [t for t in self.turn_starts if t > pos]
        end = pos
        while end < len(self.ids) and self.mask[end] == 1 and (not later or end < later[0]):
            end += 1
        rendered = self.versions[pos - 1] if pos > 0 and self.mask[pos - 1] == 0 else None
        return ReplayHit(self.ids[pos:end], self.logprobs[pos:end], self.versions[pos:end], rendered,
                         complete=end < len(self.ids))
