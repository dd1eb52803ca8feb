"""The resident runners' shared rules (gspo_ray/rollout/resident.py): which held episode is a carried record's,
and when an episode no round asks for is released."""
from __future__ import annotations

from dataclasses import dataclass

from gspo_ray.data.records import Sample
from gspo_ray.rollout.resident import MAX_IDLE_RUNS, age_idle, holds_record


@dataclass
class _Held:
    name: str
    idle_runs: int = 0


def test_an_episode_no_round_asks_for_is_released_after_max_idle_runs():
    asked, dropped = _Held("asked"), _Held("dropped")
    for run in range(MAX_IDLE_RUNS):
        assert age_idle([asked, dropped], lambda e: e is asked) == [], run
    assert (asked.idle_runs, dropped.idle_runs) == (0, MAX_IDLE_RUNS)
    assert age_idle([asked, dropped], lambda e: e is asked) == [dropped]
    dropped.idle_runs = MAX_IDLE_RUNS
    assert age_idle([dropped], lambda e: True) == [] and dropped.idle_runs == 0  # asked again: young again


def test_a_held_episode_is_the_record_only_with_the_same_prompt_and_tokens():
    s = Sample(prompt_uid="p", sample_index=0, prompt_ids=[2, 3], completion_ids=[4, 5], logprobs=[0.0, 0.0],
               loss_mask=[1, 1], versions=[0, 0], finish_reason="aborted")
    assert holds_record([2, 3], [4, 5], s) and holds_record((2, 3), (4, 5), s)
    assert not holds_record([2, 3], [4, 5, 6], s)  # the job went back to a checkpoint: rebuilt from the record
    assert not holds_record([2, 9], [4, 5], s)
