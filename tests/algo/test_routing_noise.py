"""Routing-induced log-ratio (algo/routing_noise.py): hand-worked cases and exact merging across parts."""
import math

import pytest
import torch

from gspo_ray.algo.routing_noise import merge_routing_noise_counts, routing_noise_counts, routing_noise_metrics


def _metrics(*args, **kwargs):
    return routing_noise_metrics(routing_noise_counts(*args, **kwargs))


def test_held_routing_equal_to_free_routing_is_no_noise():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 7, generator=g)
    logp = old + 0.3 * torch.randn(3, 7, generator=g)
    mask = torch.ones(3, 7, dtype=torch.bool)
    m = _metrics(logp, logp.clone(), old, torch.tensor([1.0, -1.0, 0.5]), mask)
    assert m["moe/routing_logratio_abs_mean"] == m["moe/routing_logratio_max"] == 0.0
    assert m["moe/routing_logratio_std"] == 0.0 and m["moe/routing_logratio_share"] == 0.0
    assert m["moe/grpo_token_clip_free"] == m["moe/grpo_token_clip_held"] > 0  # the weights' own change clips
    assert m["moe/grpo_token_clips_removed"] == m["moe/grpo_token_clips_added"] == 0.0
    assert m["moe/gspo_seq_clips_removed"] == 0.0 and m["moe/routing_noise_tokens"] == 21


def test_one_flipped_token_clips_under_grpo_and_moves_the_sequence_ratio_by_d_over_length():
    # a 100-token completion (A > 0) whose weights did not move its tokens (held: log r = 0), and one token whose
    # routing flipped: d = 0.5 there. GRPO clips that token (r = e^0.5 = 1.65 > 1.27): a clip routing alone caused.
    # GSPO's log s moves by d / |y| = 0.005: s = 1.005, past the 4e-4 band: also a routing-only clip.
    old = torch.full((1, 100), -1.0)
    held = old.clone()
    free = held.clone()
    free[0, 40] += 0.5
    mask = torch.ones(1, 100, dtype=torch.bool)
    m = _metrics(free, held, old, torch.tensor([1.0]), mask)
    assert m["moe/routing_logratio_max"] == pytest.approx(0.5)
    assert m["moe/routing_logratio_abs_mean"] == pytest.approx(0.005)
    assert m["moe/routing_logratio_std"] == pytest.approx(math.sqrt(0.25 / 100 - 0.005 ** 2))
    assert m["moe/routing_logratio_share"] == pytest.approx(1.0)  # all of |log r| is routing here
    assert m["moe/grpo_token_clip_free"] == pytest.approx(0.01) and m["moe/grpo_token_clip_held"] == 0.0
    assert m["moe/grpo_token_clips_removed"] == 1.0
    assert m["moe/gspo_seq_clip_free"] == 1.0 and m["moe/gspo_seq_clip_held"] == 0.0
    assert m["moe/gspo_seq_clips_removed"] == 1.0
    # with a negative advantage the same upward flip is not a clip (r > 1 only clips A > 0) ...
    m = _metrics(free, held, old, torch.tensor([-1.0]), mask)
    assert m["moe/grpo_token_clip_free"] == 0.0 and m["moe/gspo_seq_clip_free"] == 0.0
    # ... a downward one is (r = e^-0.5 = 0.61 < 0.8)
    free[0, 40] -= 1.0
    m = _metrics(free, held, old, torch.tensor([-1.0]), mask)
    assert m["moe/grpo_token_clip_free"] == pytest.approx(0.01) and m["moe/grpo_token_clips_removed"] == 1.0


def test_free_routing_can_also_hide_a_clip():
    # held routing says the token moved up by 0.4 (clipped, A > 0); free routing pulls it back to 0.1
    old = torch.zeros(1, 4)
    held = torch.tensor([[0.0, 0.4, 0.0, 0.0]])
    free = torch.tensor([[0.0, 0.1, 0.0, 0.0]])
    m = _metrics(free, held, old, torch.tensor([2.0]), torch.ones(1, 4, dtype=torch.bool))
    assert m["moe/grpo_token_clip_held"] == 0.25 and m["moe/grpo_token_clip_free"] == 0.0
    assert m["moe/grpo_token_clips_added"] == 1.0 and m["moe/grpo_token_clips_removed"] == 0.0


def test_parts_merge_into_the_whole_exactly():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(6, 9, generator=g)
    held = old + 0.2 * torch.randn(6, 9, generator=g)
    free = held + 0.3 * torch.randn(6, 9, generator=g) * (torch.rand(6, 9, generator=g) < 0.2)
    adv = torch.randn(6, generator=g)
    mask = torch.rand(6, 9, generator=g) < 0.8
    mask[2] = False  # a row with nothing to train counts nowhere
    whole = routing_noise_counts(free, held, old, adv, mask)
    parts = [routing_noise_counts(free[i:i + 2], held[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2])
             for i in (0, 2, 4)]
    merged = merge_routing_noise_counts(merge_routing_noise_counts(parts[0], parts[1]), parts[2])
    assert merged.keys() == whole.keys()
    for k in whole:
        assert merged[k] == pytest.approx(whole[k], rel=1e-12, abs=1e-12), k
    assert whole["seqs"] == 5 and whole["tokens"] == float(mask.sum())
    # per-token advantages give the same result as the broadcast sequence advantage
    per_token = routing_noise_counts(free, held, old, adv[:, None].expand(6, 9), mask)
    assert per_token == pytest.approx(whole)


def test_count_keys_are_what_the_counts_hold():
    from gspo_ray.algo.routing_noise import COUNT_KEYS

    c = routing_noise_counts(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2),
                             torch.ones(2, 3, dtype=torch.bool))
    assert tuple(c) == COUNT_KEYS
