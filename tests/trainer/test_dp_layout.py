"""Shared-prefix group rows over DP ranks (batch_layout.plan_ranks / group_micro_batches): balanced rows per rank,
micro-batches within the padded path's tokens (packed: real tokens within micro_batch_tokens, padding at the tail
only), group rows never split for width by attention, no idle rank while there are rows enough, the starved layout
said once. Pure lists and torch: no model."""
from __future__ import annotations

import logging
import math
import random

import pytest
import torch

from gspo_ray.trainer.batch_layout import (
    group_micro_batches,
    micro_batch_rows,
    padded_budget,
    plan_ranks,
    row_micro_batches,
)
from test_group_rows import group_batch


def rows_per_rank(plan):
    return [sum(len(u.rows) for pack in packs for u in pack) for packs in plan]


def plan_of(batch, dp, mbs, mbt=None, score_weight=0.0):
    parts = [group_micro_batches(batch, r, dp, mbs, mbt, score_weight=score_weight) for r in range(dp)]
    assert len({len(p) for p in parts}) == 1, "every rank runs the same number of forwards"
    seen = sorted(r for p in parts for mb in p for r in mb.rows if r >= 0)
    assert seen == list(range(batch.num_sequences)), "every row exactly once"
    return parts


def real_rows(parts):
    return [sum(1 for mb in p for r in mb.rows if r >= 0) for p in parts]


def test_rayjob_shape_gives_every_rank_its_share():
    """deploy/kuberay/rayjob.yaml: the tiny recipe (16 prompts x 8, micro_batch_size 128) at DP 8. Dealing whole
    packs gave rank 0 all 128 rows and the other seven none."""
    rng = random.Random(0)
    spec = [(8, [rng.randint(1, 6) for _ in range(8)]) for _ in range(16)]
    parts = plan_of(group_batch(spec), 8, 128)
    assert all(12 <= n <= 20 for n in real_rows(parts)), real_rows(parts)
    # the review's SmolLM2-like shape (micro_batch_size 64, micro_batch_tokens 640, 8 x 8) at DP 4: was [24, 24, 16, 0]
    spec = [(40, [rng.randint(20, 37) for _ in range(8)]) for _ in range(8)]
    parts = plan_of(group_batch(spec), 4, 64, 640)
    assert all(12 <= n <= 20 for n in real_rows(parts)), real_rows(parts)


def test_fewer_groups_than_ranks_split_groups_and_leave_no_rank_idle():
    batch = group_batch([(6, [3] * 9)])  # one prompt of 9 completions over 8 ranks
    parts = plan_of(batch, 8, 64)
    assert min(real_rows(parts)) >= 1 and max(real_rows(parts)) <= 2
    assert all(mb.layout is not None for p in parts for mb in p)


def test_lengths_balance_by_cost_over_ranks():
    """Long-tailed completions, 64 prompts x 4 over 8 ranks: the ranks' forward cost (padding included: tokens,
    plus the attention-score term when weighted) within 10% of the mean."""
    rng = random.Random(1)
    lengths, groups = [], []
    for _ in range(64):
        p = rng.randint(20, 200)
        rows = list(range(len(lengths), len(lengths) + 4))
        lengths += [p + int(min(2000, rng.paretovariate(1.2) * 30)) for _ in rows]
        groups.append((rows, p))
    for weight in (0.0, 1e-3):
        plan = plan_ranks(groups, lengths, 8, 64, None, weight)
        widths = [[max(u.length for u in pack) for pack in packs] for packs in plan]
        load = [sum(len(pack) * (w + weight * w * w) for pack, w in zip(packs, ws)) for packs, ws in zip(plan, widths)]
        assert max(load) / (sum(load) / len(load)) <= 1.10, load
        assert sorted(b for packs in plan for pack in packs for u in pack for b in u.rows) == list(range(256))


@pytest.mark.parametrize("mbt", [None, 400, 2000])
def test_micro_batches_fit_the_padded_paths_tokens(mbt):
    """Every pack holds at most the tokens a padded micro-batch holds; attention by segment holds no [W, W] score
    matrix, so nothing caps a group row's width below that (no split for width alone)."""
    rng = random.Random(2)
    spec = [(rng.randint(5, 60), [rng.randint(1, 120) for _ in range(rng.choice((1, 4, 16)))]) for _ in range(24)]
    batch = group_batch(spec, vocab=50)
    longest = int(batch.lengths.max())
    for dp in (1, 2, 4):
        budget = padded_budget(longest, 16, mbt)
        assert budget.rows == micro_batch_rows(batch, 16, mbt)
        padded = [mb for r in range(dp) for mb in row_micro_batches(batch, r, dp, 16, mbt)]
        assert max(mb.batch.tokens.numel() for mb in padded) <= budget.tokens  # what the budget stands for
        for p in plan_of(batch, dp, 16, mbt):
            for mb in p:
                r, w = mb.layout.tokens.shape
                if r > 1:
                    assert r * w <= budget.tokens, (r, w, budget)
    # a tight token cap (one padded row per micro-batch) keeps group rows within it
    tight = plan_ranks([(list(range(8)), 10)], [30] + [12] * 7, 1, 64, 30)
    assert all(u.length <= 30 for packs in tight for pack in packs for u in pack)
    assert max(len(u.rows) for packs in tight for pack in packs for u in pack) > 1
    # without a cap, a group of 16 long completions stays one group row (the dense mask split it at 4 x 30)
    loose = plan_ranks([(list(range(16)), 10)], [30] * 16, 1, 64, None)
    assert [len(u.rows) for packs in loose for pack in packs for u in pack] == [16]


def test_more_ranks_than_rows_is_said_once_with_the_numbers(caplog, monkeypatch):
    from gspo_ray.trainer import group_rows

    monkeypatch.setattr(group_rows, "_warned", set())  # once per process: start this test's process afresh
    batch = group_batch([(4, [2, 3]), (5, [1])])
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            parts = [row_micro_batches(batch, r, 5, 4, None) for r in range(5)]
            # one row per rank at most: nothing to share, the padded rows above are the layout
            assert group_micro_batches(batch, 0, 5, 4, None) is None
    said = [r.getMessage() for r in caplog.records if "DP ranks" in r.getMessage()]
    assert len(said) == 1 and "3 rows over 5 DP ranks" in said[0] and "2 ranks get no row" in said[0], said
    assert sum(1 for p in parts if all(r < 0 for mb in p for r in mb.rows)) == 2


def test_micro_batch_tokens_below_the_longest_row_is_a_config_error():
    from gspo_ray.config import load_config

    with pytest.raises(ValueError) as e:
        load_config("gspo_ray/recipes/tiny_moe.yaml", ["trainer.micro_batch_tokens=32"])
    text = str(e.value)
    assert "trainer.micro_batch_tokens" in text and "32" in text and "64" in text, text
    assert load_config("gspo_ray/recipes/tiny_moe.yaml", ["trainer.micro_batch_tokens=64"]).trainer.micro_batch_tokens


def test_plan_is_the_same_on_every_rank_and_deterministic():
    rng = random.Random(3)
    spec = [(rng.randint(2, 9), [rng.randint(1, 7) for _ in range(rng.randint(1, 8))]) for _ in range(10)]
    batch = group_batch(spec)
    a = [[mb.rows for mb in p] for p in plan_of(batch, 3, 6)]
    b = [[mb.rows for mb in p] for p in plan_of(batch, 3, 6)]
    assert a == b and math.prod(len(p) for p in a) > 0


@pytest.mark.parametrize("shared", [False, True])
def test_packed_micro_batches_hold_real_tokens_within_the_budget(shared):
    """Packed rows (trainer.packed_rows) at DP 2 under sequence parallelism (TP 2): every row exactly once, one
    packed row per micro-batch of at most micro_batch_size rows and micro_batch_tokens real tokens (a longer row
    alone), padded only at its tail to a multiple of TP; every token at its column with its own position (from 0
    in each sequence, or continuing its group row's prefix); the ranks' forward counts equal."""
    rng = random.Random(5)
    spec = [(rng.randint(1, 9), [rng.randint(0, 30) for _ in range(rng.randint(1, 6))]) for _ in range(9)]
    batch = group_batch(spec)
    mbs, mbt = 5, 48
    make = group_micro_batches if shared else row_micro_batches
    parts = [make(batch, r, 2, mbs, mbt, 2, 0.01, packed=True) if shared else
             make(batch, r, 2, mbs, mbt, packed=True, width_multiple=2, score_weight=0.01) for r in range(2)]
    assert len(parts[0]) == len(parts[1])
    assert sorted(r for p in parts for mb in p for r in mb.rows if r >= 0) == list(range(batch.num_sequences))
    longest = int(batch.lengths.max())
    for mb in (mb for p in parts for mb in p):
        lay, real = mb.layout, int(mb.layout.lengths.sum())
        assert lay.tokens.shape[0] == 1 and lay.segments.packed
        assert lay.tokens.shape[1] % 2 == 0 and 0 <= lay.tokens.shape[1] - real < 2
        assert len(mb.rows) <= mbs and (real <= max(mbt, longest) or len(mb.rows) == 1)
        if not shared:  # each sequence its own unit: the tokens forwarded are the rows' own
            assert real == int(mb.batch.lengths.sum())
        for b in range(mb.batch.num_sequences):
            n = int(mb.batch.lengths[b])
            cols = lay.col_of[b, :n]
            assert (lay.tokens[0, cols] == mb.batch.tokens[b, :n]).all()
            assert (lay.position_ids[0, cols] == torch.arange(n)).all()
    padded = [row_micro_batches(batch, r, 2, mbs, mbt) for r in range(2)]
    assert sum(mb.num_tokens for p in parts for mb in p) < sum(mb.num_tokens for p in padded for mb in p)
