"""A carried multi-turn episode's record, read back into its turns (to rebuild the episode by replaying its env).

    turns, open_turn = recorded_turns(sample)     # [RecordedTurn(start, end, next)], whether the last one was cut

An unfinished episode's Sample ("aborted", gspo_ray/rollout/episodes.py) is its whole state bar the env object:
the prompt, then the first observation, then per model turn its tokens (loss_mask 1, the engine's log-probs, the
versions that sampled them) and the observation that answered it (mask 0). A token-space env is deterministic
given (prompt, seed, actions) when it declares `replayable = True`, so the env object is rebuilt by `reset` with
the episode's seed and one `step` per recorded action; the runner (`EpisodeRunner._replay`) checks each replayed
observation and reward against the record. Pure: no engine, no env.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RecordedTurn:
    """Model turn k of a record: its tokens are completion_ids[start:end]; the observation that answered it is
    completion_ids[end:next] (empty for the record's last, cut turn)."""

    start: int
    end: int
    next: int


def recorded_turns(sample: Any) -> tuple[list[RecordedTurn], bool]:
    """The record's model turns (from `turn_starts`, else from runs of loss_mask 1) and whether its last turn was
    cut by a round (reward_info["turn_open"]): then it has no observation yet and the engine continues it."""
    mask, n = sample.loss_mask, len(sample.completion_ids)
    starts = list(sample.turn_starts) if sample.turn_starts is not None else [
        t for t in range(n) if mask[t] == 1 and (t == 0 or mask[t - 1] == 0)]
    turns = []
    for k, start in enumerate(starts):
        nxt = starts[k + 1] if k + 1 < len(starts) else n
        end = start
        while end < nxt and mask[end] == 1:
            end += 1
        turns.append(RecordedTurn(start, end, nxt))
    return turns, bool(sample.reward_info.get("turn_open", 0.0))
