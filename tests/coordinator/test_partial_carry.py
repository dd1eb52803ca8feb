"""Partial-rollout bookkeeping on hand-built samples: the carry, the buffer's staleness rule, checkpoints, config."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from gspo_ray.config import ConfigError, PartialRolloutConfig, load_config
from gspo_ray.coordinator.buffer import GroupBuffer
from gspo_ray.coordinator.partial_carry import PartialCarry, group_from_dict, group_to_dict
from gspo_ray.data.records import Group, Prompt, Sample, unpack_routes


def _sample(uid, index, versions, finish="stop", reward=None, segments=1, routes=False) -> Sample:
    """routes: engine routes (R3) on every position but the last, as the engine returns them (2 MoE layers, top-2)."""
    n = len(versions)
    packed = None
    if routes:
        import numpy as np

        from gspo_ray.data.records import pack_routes

        r = np.random.default_rng(index + 10 * n).integers(0, 8, (2 + n, 2, 2)).astype(np.int16)
        r[-1] = -1
        packed = pack_routes(r)
    return Sample(prompt_uid=uid, sample_index=index, prompt_ids=[2, 3], completion_ids=list(range(4, 4 + n)),
                  logprobs=[-0.25] * n, loss_mask=[1] * n, versions=list(versions), finish_reason=finish,
                  reward=reward, segments=segments, routes=packed)


def _group(uid, samples) -> Group:
    return Group(prompt=Prompt(uid=uid, prompt_ids=[2, 3], reference="ab", text="x"), samples=samples)


def test_only_whole_finished_groups_leave_the_carry():
    carry = PartialCarry(PartialRolloutConfig(segment_tokens=2, max_segments=3))
    done = _group("done", [_sample("done", 0, [0, 0], reward=1.0), _sample("done", 1, [0], reward=0.0)])
    half = _group("half", [_sample("half", 0, [0, 0], reward=1.0), _sample("half", 1, [0, 0], "aborted")])
    ready = carry.absorb([done, half])
    assert [g.uid for g in ready] == ["done"] and list(carry.open) == ["half"]
    # the finished member waits with its reward; the group goes out whole for its next segment
    work, _ = carry.take_open(current_version=1)
    (prompt, samples, budget), = work
    assert prompt.uid == "half" and [s.finish_reason for s in samples] == ["stop", "aborted"]
    assert budget == 2 and len(carry) == 0


def test_last_segment_runs_without_a_budget():
    carry = PartialCarry(PartialRolloutConfig(segment_tokens=2, max_segments=3))
    assert [carry.budget_for(done) for done in (0, 1, 2)] == [2, 2, None]
    carry.absorb([_group("g", [_sample("g", 0, [0] * 4, "aborted", segments=2),
                               _sample("g", 1, [0] * 2, "aborted", segments=1)])])
    (_, _, budget), = carry.take_open(0)[0]
    assert budget is None  # the group has had 2 of its 3 segments


def test_drop_policy_stops_continuing_hopeless_completions():
    carry = PartialCarry(PartialRolloutConfig(segment_tokens=2, max_segments=4, stale_policy="drop",
                                              max_staleness=1))
    old = _sample("g", 0, [3, 3], "aborted")          # version 3: 2 behind version 5, too stale
    fresh = _sample("g", 1, [4, 4], "aborted", segments=1)
    other = _sample("g", 2, [5], "stop", reward=1.0)
    lone = _group("lone", [_sample("lone", 0, [3], "aborted"), _sample("lone", 1, [5], "stop", reward=0.0)])
    carry.absorb([_group("g", [old, fresh, other]), lone])
    work, stats = carry.take_open(current_version=5)
    assert [(p.uid, [s.sample_index for s in ss]) for p, ss, _ in work] == [("g", [1, 2])]
    assert stats.dropped_samples == 3  # old, and both members of "lone" (one left cannot make a group)


def test_buffer_applies_the_stale_rule_at_admission_and_again_while_waiting():
    buf = GroupBuffer(stale_rule=("mask", 1), filter_zero_adv=False)
    s0 = _sample("g", 0, [3, 4, 5], reward=1.0)
    s1 = _sample("g", 1, [5, 5], reward=0.0)
    stats = buf.admit([_group("g", [s0, s1])], current_version=5)
    assert stats.stale_masked_tokens == 1 and buf.groups[0].samples[0].loss_mask == [0, 1, 1]
    adv_before = list(buf.groups[0].advantages)
    assert buf.drop_stale(current_version=6) == 0  # still waiting at version 6: version 4 is now too old too
    assert buf.groups[0].samples[0].loss_mask == [0, 0, 1]
    assert buf.groups[0].advantages == adv_before  # masking never changes the rewards

    drop = GroupBuffer(stale_rule=("drop", 1))
    stats = drop.admit([_group("g", [_sample("g", 0, [3, 5], reward=1.0), _sample("g", 1, [5], reward=0.0),
                                     _sample("g", 2, [5], reward=0.5)])], current_version=5)
    assert stats.stale_dropped_samples == 1 and [s.sample_index for s in drop.groups[0].samples] == [1, 2]
    a = 0.25 / (0.125 ** 0.5 + 1e-4)  # rewards 0 and 0.5: the two that remain, std ddof=1, eps 1e-4
    assert drop.groups[0].advantages == pytest.approx([-a, a], abs=1e-9)


def test_open_groups_round_trip_through_json():
    carry = PartialCarry(PartialRolloutConfig(segment_tokens=2))
    g = _group("g", [_sample("g", 0, [0, 1], "aborted", segments=2), _sample("g", 1, [1], "stop", reward=0.5)])
    carry.absorb([g])
    restored = PartialCarry(PartialRolloutConfig(segment_tokens=2))
    restored.load_state_dict(json.loads(json.dumps(carry.state_dict())))
    assert restored.open["g"].samples == g.samples and restored.open["g"].prompt == g.prompt
    assert group_from_dict(group_to_dict(g.prompt, g.samples)) == (g.prompt, g.samples)


GUESS = "rollout.multi_turn.env=gspo_ray.envs.guess:GuessNumberEnv"


@pytest.mark.parametrize("overrides,field", [
    (["rollout.partial.segment_tokens=16"], "segment_tokens (16) must be below rollout.max_new_tokens (16)"),
    (["rollout.partial.max_segments=1"], "rollout.partial.max_segments"),
    ([GUESS, "rollout.multi_turn.max_total_tokens=4"],  # native episodes: their own limit, not max_new_tokens
     "segment_tokens (4) must be below rollout.multi_turn.max_total_tokens (4)"),
])
def test_config_refuses_partial_rollouts_that_cannot_work(overrides, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, ["rollout.partial.segment_tokens=4", *overrides])
    assert load_config(None, ["rollout.partial.segment_tokens=4"]).rollout.partial.max_segments == 4
    # multi-turn episodes are cut by segment_tokens whatever rollout.max_new_tokens (16) is: only their limit counts
    assert load_config(None, ["rollout.partial.segment_tokens=16", GUESS]).rollout.multi_turn.max_total_tokens == 64


def test_prompts_in_flight_and_waiting_groups_survive_a_checkpoint(tmp_path):
    from gspo_ray.coordinator.loop import Coordinator, LoopState
    from gspo_ray.coordinator.rollout_pool import PendingRollout
    from gspo_ray.data.prompts import PromptSource
    from gspo_ray.models.tiny import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path)
    cfg = load_config(None, ["coordinator.mode=async", "rollout.partial.segment_tokens=4"])
    src = PromptSource.from_task("copy", str(tmp_path), seed=1)
    coord = Coordinator(cfg, None, None, src, LoopState())  # the bookkeeping only: no pools needed
    in_flight = src.take(3)
    # R3: every sample carries the engine's routes of its finished segments (they must come back unchanged)
    half = _group("h", [_sample("h", 0, [0, 0], "aborted", segments=2, routes=True),
                        _sample("h", 1, [0], reward=0.5, routes=True)])
    kept = _group("k", [_sample("k", 0, [0, 1, 1], "aborted", segments=3, routes=True),
                        _sample("k", 1, [0, 1], "aborted", segments=2, routes=True)])
    assert coord.partial.absorb([kept]) == []  # open between rounds (not in this round)
    # async: this round samples while we train; it started 3 prompts and continues one unfinished group
    coord._pending = PendingRollout(prompts=in_flight + [half.prompt], n=2, sampling={}, fresh=in_flight,
                                    carried=[(half.prompt, half.samples, 4)])
    waiting = _group("w", [_sample("w", 0, [0, 0], reward=1.0, routes=True), _sample("w", 1, [0], reward=0.0,
                                                                                    routes=True)])
    assert coord.buffer.admit([waiting], current_version=0).admitted == 1  # scored, not trained yet
    state, cursor = json.loads(json.dumps(coord.state_dict())), src.state_dict()
    expected_next = src.take(2)

    resumed_src = PromptSource.from_task("copy", str(tmp_path), seed=1)
    resumed_src.load_state_dict(cursor)
    resumed = Coordinator(cfg, None, None, resumed_src, LoopState())
    resumed.load_state_dict(state)
    # the 3 prompts that were generating when the checkpoint was taken are not lost, and nothing is repeated
    assert resumed._take_prompts(5) == in_flight + expected_next
    assert resumed.state.prompts_drawn == 5
    assert [g.uid for g in resumed.buffer.groups] == ["w"] and resumed.buffer.groups[0].samples == waiting.samples
    assert list(resumed.partial.open) == ["k", "h"] and resumed.partial.open["h"].samples == half.samples
    assert resumed.partial.open["k"].samples == kept.samples
    # the routes themselves (Sample equality compares their packed records), not only their presence
    back = [s for g in (*resumed.partial.open.values(), *resumed.buffer.groups) for s in g.samples]
    assert len(back) == 6 and all(s.routes is not None for s in back)
    orig = {(x.prompt_uid, x.sample_index): x.routes for g in (half, kept, waiting) for x in g.samples}
    for s in back:
        np.testing.assert_array_equal(unpack_routes(s.routes), unpack_routes(orig[s.prompt_uid, s.sample_index]))


def test_carried_episodes_go_to_the_worker_of_their_unfinished_members():
    """A group rebuilt on worker 2 after worker 0 died: its finished member still names worker 0, its unfinished
    ones name worker 2, which holds them now."""
    from gspo_ray.coordinator.rollout_pool import episode_owners

    rebuilt = [dataclasses.replace(_sample("g", 0, [0], "aborted"), worker_id=2),
               dataclasses.replace(_sample("g", 1, [0], "stop", reward=1.0), worker_id=0)]
    finished = [dataclasses.replace(_sample("h", 0, [0], "stop", reward=0.0), worker_id=1)]
    assert episode_owners(rebuilt) == {"g": 2} and episode_owners(rebuilt[::-1]) == {"g": 2}
    assert episode_owners(finished) == {}  # no unfinished member: any worker returns it as it is
