"""Staleness rules of partial rollouts on hand-built samples (pure; no engine)."""
from __future__ import annotations

import pytest

from gspo_ray.config import PartialRolloutConfig, RolloutConfig
from gspo_ray.data.records import Sample
from gspo_ray.rollout.partial import (STALE_POLICIES, apply_stale_policy, compute_sample_staleness,
                                      compute_token_staleness, filter_stale, group_ready)


def _sample(versions, mask=None, finish="stop", index=0) -> Sample:
    n = len(versions)
    return Sample(prompt_uid="p", sample_index=index, prompt_ids=[2, 3], completion_ids=list(range(3, 3 + n)),
                  logprobs=[-0.5] * n, loss_mask=list(mask or [1] * n), versions=list(versions),
                  finish_reason=finish, reward=1.0)


# Three segments sampled by versions 3, 4 and 5; now the policy is at version 5.
SPAN = [3, 3, 4, 4, 5, 5]


def test_token_staleness():
    assert compute_token_staleness(SPAN, 5) == [2, 2, 1, 1, 0, 0]
    assert compute_sample_staleness(_sample(SPAN), 5) == 2
    # environment tokens (mask 0) do not count: the oldest trainable token is version 4
    assert compute_sample_staleness(_sample(SPAN, mask=[0, 0, 1, 1, 1, 1]), 5) == 1
    with pytest.raises(ValueError, match="newer than the current version 4"):
        compute_token_staleness(SPAN, 4)


def test_keep_trains_everything():
    s = _sample(SPAN)
    assert apply_stale_policy(s, 5, "keep", 0) is s


@pytest.mark.parametrize("max_staleness,mask", [(0, [0, 0, 0, 0, 1, 1]),   # only version 5 is fresh
                                                (1, [0, 0, 1, 1, 1, 1]),   # 5 - 3 = 2 > 1: version 3 masked
                                                (2, [1, 1, 1, 1, 1, 1])])
def test_mask_turns_off_old_tokens(max_staleness, mask):
    s = _sample(SPAN)
    out = apply_stale_policy(s, 5, "mask", max_staleness)
    assert out.loss_mask == mask
    assert s.loss_mask == [1] * 6, "the input sample must not change"
    assert (out.completion_ids, out.logprobs, out.versions, out.reward) == (
        s.completion_ids, s.logprobs, s.versions, s.reward)


def test_mask_keeps_env_tokens_masked():
    out = apply_stale_policy(_sample(SPAN, mask=[1, 0, 1, 0, 1, 0]), 5, "mask", 1)
    assert out.loss_mask == [0, 0, 1, 0, 1, 0]


def test_mask_can_mask_everything_and_keeps_the_sample():
    out = apply_stale_policy(_sample([1, 1, 2]), 5, "mask", 1)
    assert out is not None and out.loss_mask == [0, 0, 0]


@pytest.mark.parametrize("max_staleness,dropped", [(0, True), (1, True), (2, False)])
def test_drop_discards_samples_with_old_tokens(max_staleness, dropped):
    s = _sample(SPAN)
    out = apply_stale_policy(s, 5, "drop", max_staleness)
    assert (out is None) == dropped and (dropped or out is s)


def test_drop_ignores_old_env_tokens():
    # versions 3 only on tokens that never train: nothing trainable is too old
    s = _sample(SPAN, mask=[0, 0, 1, 1, 1, 1])
    assert apply_stale_policy(s, 5, "drop", 1) is s


def test_filter_stale_counts():
    batch = [_sample(SPAN, index=0), _sample([5, 5], index=1), _sample([2, 5], index=2)]
    kept, stats = filter_stale(batch, 5, "mask", 1)
    assert [s.loss_mask for s in kept] == [[0, 0, 1, 1, 1, 1], [1, 1], [0, 1]]
    assert (stats.dropped_samples, stats.masked_tokens, stats.max_staleness) == (0, 3, 3)
    kept, stats = filter_stale(batch, 5, "drop", 1)
    assert [s.sample_index for s in kept] == [1] and stats.dropped_samples == 2
    assert (stats.num_samples, stats.masked_tokens) == (3, 0)
    kept, stats = filter_stale(batch, 5, "keep", 0)
    assert kept == batch and stats.masked_tokens == 0


@pytest.mark.parametrize("policy,max_staleness,match", [("fresh", 1, "valid: keep, mask, drop"),
                                                        ("mask", -1, "max_staleness")])
def test_bad_policy_is_rejected(policy, max_staleness, match):
    with pytest.raises(ValueError, match=match):
        apply_stale_policy(_sample(SPAN), 5, policy, max_staleness)


def test_config_policies_match():
    assert set(PartialRolloutConfig.model_fields["stale_policy"].annotation.__args__) == set(STALE_POLICIES)
    cfg = RolloutConfig(partial={"segment_tokens": 2, "stale_policy": "drop"})
    assert (cfg.partial.segment_tokens, cfg.partial.max_staleness) == (2, 1)
    with pytest.raises(ValueError):
        RolloutConfig(partial={"stale_policy": "fresh"})


def test_group_ready():
    done = [_sample([1]), _sample([1], finish="length"), _sample([1], finish="env_error")]
    assert group_ready(done)
    assert not group_ready(done + [_sample([1], finish="aborted")])
    assert not group_ready([])
