"""Shared-prefix layout (trainer/group_rows.py, batch_layout.group_micro_batches): what each query attends to,
positions, index maps, packing, DP split and fallbacks. Pure torch: no model, no Megatron."""
from __future__ import annotations

import torch

from gspo_ray.data.records import Sample, TrainBatch, collate
from gspo_ray.trainer.batch_layout import group_micro_batches, loss_units
from gspo_ray.trainer.group_rows import (
    GroupRow,
    build_layout,
    common_prefix,
    find_groups,
    pack_group_rows,
    plan_units,
    prefix_groups,
    shard_token_order,
)
from gspo_ray.trainer.attention.segment_attention import Segments, attend_rows


def group_batch(spec, seed=0, vocab=22, masked=()):
    """spec: [(prompt_len, [completion lengths])] -> TrainBatch; rows in `masked` get loss_mask 0."""
    g = torch.Generator().manual_seed(seed)
    samples, advs = [], []
    for p_i, (p, cs) in enumerate(spec):
        prompt = torch.randint(3, vocab, (p,), generator=g).tolist()
        for j, c in enumerate(cs):
            comp = torch.randint(3, vocab, (c,), generator=g).tolist()
            m = 0 if len(samples) in masked else 1
            samples.append(Sample(prompt_uid=f"q{p_i}", sample_index=j, prompt_ids=prompt, completion_ids=comp,
                                  logprobs=[-1.0] * c, loss_mask=[m] * c, versions=[0] * c, finish_reason="stop"))
            advs.append([float(j) - 1.0] * c)
    return collate(samples, advs)


def plan_group_rows(batch, max_rows, max_width=None):
    """The group rows of a whole batch, as the trainer plans them (None: nothing to share)."""
    groups = prefix_groups(batch)
    if groups is None:
        return None
    return plan_units(groups, batch.lengths.tolist(), max_rows, max_width, batch.uids)


def visible(layout, r):
    """[W, W] bool: which columns the query of each column of group row r attends to, read off the attention
    itself (values one-hot per column: the output of a query is nonzero exactly where it attends)."""
    width = layout.tokens.shape[1]
    q, k = torch.randn(width, 1, 1, 4, dtype=torch.float64), torch.randn(width, 1, 1, 4, dtype=torch.float64)
    v = torch.eye(width, dtype=torch.float64)[:, None, None, :]
    segs = Segments((layout.segments.prefix[r],), (layout.segments.completions[r],))
    return attend_rows(q, k, v, segs)[:, 0, 0, :] != 0


def test_mask_positions_and_index_map_of_one_group():
    batch = group_batch([(3, [2, 1, 3])])
    batch.tokens[1, 3] = batch.tokens[0, 3] = 7  # rows 0, 1 share their first completion token too; row 2 not
    batch.tokens[2, 3] = 8
    (unit,) = plan_group_rows(batch, max_rows=8)
    assert unit == GroupRow((0, 1, 2), 3, (2, 1, 3))
    lay = build_layout(batch, [unit])
    assert lay.tokens.shape == (1, 9) and lay.lengths.tolist() == [9]
    # [x0 x1 x2 | a0 a1 | b0 | c0 c1 c2]
    assert lay.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 3, 4, 5]
    v = visible(lay, 0)
    assert v[:3, :3].equal(torch.ones(3, 3, dtype=torch.bool).tril()) and not v[:3, 3:].any()  # prefix causal
    assert v[4].tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 0]  # a1 sees the prefix and a0
    assert v[5].tolist() == [1, 1, 1, 0, 0, 1, 0, 0, 0]  # b0 sees the prefix only (and itself)
    assert v[8].tolist() == [1, 1, 1, 0, 0, 0, 1, 1, 1]
    assert lay.row_of.tolist() == [0, 0, 0]
    for b in range(3):
        n = int(batch.lengths[b])
        assert torch.equal(lay.tokens[0, lay.col_of[b, :n]], batch.tokens[b, :n])  # the map finds every token
        assert (lay.col_of[b, n:] == -1).all()
        # the column before token t holds position t - 1 and sees exactly the row's earlier tokens
        for t in range(1, n):
            col = lay.col_of[b, t - 1]
            assert lay.position_ids[0, col] == t - 1
            seen = v[col].nonzero().flatten()
            assert torch.equal(lay.tokens[0, seen], batch.tokens[b, :t])


def test_longest_common_prefix_never_guesses_from_the_loss_mask():
    batch = group_batch([(4, [3, 3])], masked=(0, 1))  # both completions fully masked: still a plain prefix
    assert common_prefix(batch.tokens, batch.lengths, [0, 1]) >= 4
    batch.tokens[1, 2] = 0 if batch.tokens[0, 2] else 1  # rows differ inside the "prompt": prefix stops there
    assert common_prefix(batch.tokens, batch.lengths, [0, 1]) == 2
    same = group_batch([(4, [3])])
    two = TrainBatch(tokens=same.tokens.repeat(2, 1), loss_mask=same.loss_mask.repeat(2, 1),
                     old_logp=same.old_logp.repeat(2, 1), adv=same.adv.repeat(2, 1), lengths=same.lengths.repeat(2),
                     uids=["a/0", "a/1"])
    (unit,) = plan_group_rows(two, 8)
    assert unit.prefix == 7 and unit.segments == (0, 0)  # identical rows: everything is prefix
    lay = build_layout(two, [unit])
    assert lay.col_of[1, :7].tolist() == list(range(7))


def test_groups_split_by_rows_tokens_and_width_and_pack_into_micro_batches():
    batch = group_batch([(5, [2] * 8), (3, [4, 1]), (6, [3])])
    units = plan_group_rows(batch, max_rows=3)
    assert [u.rows for u in units] == [(0, 1, 2), (3, 4, 5), (6, 7), (8, 9), (10,)]
    assert all(len(u.rows) <= 3 for u in units)
    capped = plan_group_rows(batch, max_rows=8, max_width=10)
    assert all(u.length <= 10 for u in capped if len(u.rows) > 1)
    packs = pack_group_rows(units, max_rows=4, max_tokens=None)
    assert sorted(r for p in packs for u in p for r in u.rows) == list(range(11))
    assert all(sum(len(u.rows) for u in p) <= 4 for p in packs)
    packs = pack_group_rows(units, max_rows=64, max_tokens=24)
    assert all(len(p) * max(u.length for u in p) <= 24 or len(p) == 1 for p in packs)


def test_fallbacks_no_uids_no_shared_prefix_singletons():
    batch = group_batch([(3, [2, 2])])
    assert plan_group_rows(batch.select([0]), 8) is None  # one row: nothing to share
    no_uids = batch.select([0, 1])
    no_uids.uids = []
    assert find_groups(no_uids.uids, 2) is None and plan_group_rows(no_uids, 8) is None
    diff = group_batch([(3, [2]), (3, [2])])
    diff.uids = ["same/0", "same/1"]  # one "prompt" whose rows differ from token 0
    diff.tokens[1, 0] = 0 if diff.tokens[0, 0] else 1
    assert plan_group_rows(diff, 8) is None  # forwarded unshared
    mixed = group_batch([(3, [2, 2]), (3, [2])])
    mixed.uids[2] = "q0/9"  # joins q0 but does not share its prompt
    mixed.tokens[2, 0] = 0 if mixed.tokens[0, 0] else 1
    assert plan_group_rows(mixed, 8) is None  # q0's rows share no token: each is its own row, nothing shared
    mixed.tokens[2, 0] = mixed.tokens[0, 0]  # now they share >= 1 token: one group row
    (unit,) = plan_group_rows(mixed, 8)
    assert unit.rows == (0, 1, 2) and unit.prefix >= 1


def test_micro_batches_cover_every_row_once_over_dp_and_pad_with_masked_dummies():
    batch = group_batch([(5, [3, 2, 4]), (4, [2, 2]), (6, [1]), (3, [5, 5, 5, 5])], masked=(4,))
    parts = [group_micro_batches(batch, r, 2, micro_batch_size=4, micro_batch_tokens=None, width_multiple=2)
             for r in range(2)]
    assert len(parts[0]) == len(parts[1])  # equal forwards on every rank
    seen = []
    for mbs in parts:
        for mb in mbs:
            assert mb.layout.tokens.shape[1] % 2 == 0
            real = [r for r in mb.rows if r >= 0]
            seen += real
            for i, r in enumerate(mb.rows):
                if r < 0:  # dummy: trains nothing
                    assert mb.batch.loss_mask[i].sum() == 0 and mb.batch.adv[i].abs().sum() == 0
                    continue
                n = int(batch.lengths[r])
                assert torch.equal(mb.batch.tokens[i, :n], batch.tokens[r, :n])
                assert torch.equal(mb.batch.loss_mask[i, :n], batch.loss_mask[r, :n])
    assert sorted(seen) == list(range(batch.num_sequences))  # every row exactly once
    units = sum(loss_units(mb.batch.loss_mask, "seq-mean-token-mean") for mbs in parts for mb in mbs)
    assert units == loss_units(batch.loss_mask, "seq-mean-token-mean")
    # micro_batch_size 2, q0's group row above half a rank's cost is halved to single rows: rank 0 gets rows 0, 2
    # and 4 in two micro-batches, rank 1 rows 1, 3 in one, plus a dummy
    uneven = group_batch([(5, [3, 3, 3, 3]), (3, [1])])
    mbs = [group_micro_batches(uneven, r, 2, 2, None) for r in range(2)]
    assert [[mb.rows for mb in m] for m in mbs] == [[[0, 2], [4]], [[1, 3], [-1]]]


def test_shard_token_order_expands_group_records_to_unshared_tokens():
    batch = group_batch([(4, [2, 3]), (3, [1])])
    units = plan_group_rows(batch, 8)
    lay = build_layout(batch, units, width_multiple=2)
    rows, width = lay.tokens.shape

    def recorded(off, s_local):  # what a router hook keeps: real group-row tokens, sequence-major (here: their ids)
        return [int(lay.tokens[g, s]) for s in range(off, off + s_local) for g in range(rows) if s < lay.lengths[g]]

    for tp in (1, 2):
        s_local, got = width // tp, []
        for rank in range(tp):
            off = rank * s_local
            rec = recorded(off, s_local)
            idx = shard_token_order(lay, batch.lengths, s_local, off)
            got += [rec[i] for i in idx.tolist()]
        want = [int(batch.tokens[b, t]) for b in range(batch.num_sequences) for t in range(int(batch.lengths[b]))]
        assert sorted(got) == sorted(want) and len(got) == int(batch.lengths.sum())
    idx = shard_token_order(lay, batch.lengths, width, 0)
    rec = recorded(0, width)
    assert [rec[i] for i in idx.tolist()] == [int(batch.tokens[b, t]) for b in range(batch.num_sequences)
                                             for t in range(int(batch.lengths[b]))]
