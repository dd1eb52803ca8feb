"""What the two resident runners (native env episodes, gspo_ray/rollout/episodes.py; agent episodes,
gspo_ray/rollout/agent/runner.py) share about the episodes they keep between partial-rollout rounds.

    if not holds_record(prompt_ids, completion_ids, carried_sample): ...   # a rewound job: rebuild from the record
    for episode in age_idle(resident_episodes, asked=lambda e: e in this_round): release(episode)
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, TypeVar

MAX_IDLE_RUNS = 32  # a resident episode no round asked for in this many runs is released (its group was dropped)

T = TypeVar("T")


def holds_record(prompt_ids: list[int], completion_ids: list[int], sample: Any) -> bool:
    """Whether a held episode (its prompt and completion ids so far) is the one the carried sample records. Not so
    when the job went back to a checkpoint: the carried record is then the one to train, and the episode is rebuilt
    from it."""
    return list(prompt_ids) == list(sample.prompt_ids) and list(completion_ids) == list(sample.completion_ids)


def age_idle(held: Iterable[T], asked: Callable[[T], bool]) -> list[T]:
    """One run more for each held episode (its `idle_runs`): back to 0 for those this run `asked` for, +1 for the
    others. Returns those idle for more than MAX_IDLE_RUNS runs, for the caller to release: their group was dropped
    (a stale-policy drop, a rewound job), so no round will continue them."""
    gone = []
    for episode in held:
        episode.idle_runs = 0 if asked(episode) else episode.idle_runs + 1
        if episode.idle_runs > MAX_IDLE_RUNS:
            gone.append(episode)
    return gone
