"""trainer/checkpoints/shards.py on hand-made checkpoints (no process group): who owns what, and how slices saved by one
layout are read back in another (DP slices joined, TP shards joined and re-split, experts renamed across EP sizes), and
a missing slice named."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gspo_ray.trainer.checkpoints.shards import MissingShardError, Owners, SavedShards

QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
EXPERT = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc2.weight"


def _lay(rank, tp_rank=0, ep_rank=0):
    return dict(rank=rank, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=0, pp_rank=0)


def test_one_owner_per_tensor_and_coordinate():
    # world 4 = DP 2 x TP 2 (ranks 0, 1: tp 0, 1 of DP rank 0), EP 2 over ranks (0, 1) and (2, 3)
    layouts = [_lay(0, 0, 0), _lay(1, 1, 0), _lay(2, 0, 1), _lay(3, 1, 1)]
    owners = [Owners(layouts, r) for r in range(4)]
    assert [o.owns(QKV) for o in owners] == [True, True, False, False]              # DP rank 0 of each TP shard
    assert [o.owns(EXPERT.format(0)) for o in owners] == [True, False, True, False]  # the first of each EP group
    assert owners[0].holders(QKV, tp_rank=1, ep_rank=0) == [1, 3]
    assert owners[0].holders(EXPERT.format(0), tp_rank=0, ep_rank=1) == [2, 3]


def _piece(start, flat, shape):
    return {"start": start, "shape": list(shape), "step": torch.tensor(3.0), "exp_avg": flat, "exp_avg_sq": flat * 2}


def _saved(payloads, meta, spec):
    return SavedShards("ckpt", meta, spec, lambda d, r: payloads[r])


def test_dp_slices_and_tp_shards_are_joined_for_another_layout():
    # saved: TP 2 x DP 2 (ranks 0, 1 = tp 0, 1 at dp 0; ranks 2, 3 at dp 1); a [4 kv-groups x 2, 3] qkv weight
    spec1 = SimpleNamespace(tp=1, ep=1, arch="qwen3_moe", num_experts=0, padded_vocab_size=8, vocab_size=8)
    full = torch.arange(24.0).reshape(8, 3)
    shards = full.chunk(2, 0)  # "col": TP rank r holds rows r*4 .. r*4+3
    layouts = [_lay(0, 0), _lay(1, 1), _lay(2, 0), _lay(3, 1)]
    payloads = []
    for r, lay in enumerate(layouts):
        local = shards[lay["tp_rank"]].reshape(-1)
        dp = r // 2  # the distributed optimizer: DP rank dp updates half of the flattened local tensor
        piece = _piece(6 * dp, -local[6 * dp:6 * dp + 6], (4, 3))
        model = {QKV: shards[lay["tp_rank"]]} if dp == 0 else {}
        payloads.append({"model": model, "optimizer": {"params": {QKV: piece}, "scalers": [None]}})
    saved = _saved(payloads, {"tp": 2, "ep": 1, "layouts": layouts}, spec1)
    assert torch.equal(saved.tensor("model", QKV, _lay(0), None), full)
    assert torch.equal(saved.tensor("exp_avg", QKV, _lay(0), None), -full)
    assert torch.equal(saved.tensor("exp_avg_sq", QKV, _lay(0), None), -2 * full)
    # one slice file lost: named, never a half-filled tensor
    del payloads[3]["optimizer"]["params"][QKV]
    with pytest.raises(MissingShardError, match="cover 6 of 12"):
        saved.tensor("exp_avg", QKV, _lay(0), None)


def test_experts_move_to_their_saved_ep_rank():
    # saved at EP 2 (2 local experts a rank) -> read at EP 1 (4 local experts) and at EP 4 (1)
    layouts = [_lay(0, 0, 0), _lay(1, 0, 1)]
    payloads = [{"model": {EXPERT.format(j): torch.full((2, 2), 10.0 * r + j) for j in range(2)},
                 "optimizer": {"params": {}, "scalers": [None]}} for r in range(2)]
    meta = {"tp": 1, "ep": 2, "layouts": layouts}
    one = _saved(payloads, meta, SimpleNamespace(tp=1, ep=1, num_experts=4))
    assert [float(one.tensor("model", EXPERT.format(g), _lay(0), None)[0, 0]) for g in range(4)] == [0, 1, 10, 11]
    four = _saved(payloads, meta, SimpleNamespace(tp=1, ep=4, num_experts=4))
    assert [float(four.tensor("model", EXPERT.format(0), _lay(e, 0, e), None)[0, 0]) for e in range(4)] == [
        0, 1, 10, 11]
    assert four.tensor("exp_avg", EXPERT.format(0), _lay(3, 0, 3), None) is None  # no state saved: a fresh start
