"""The scale model (bench/scale.py) runs the trainer's own planning code at cluster shapes: its layout meets the
balance the DP layout promises, and its byte counts are what the model shapes imply. Pure lists and meta tensors:
no weights, no process group (the whole bench, routing-record store included, is `gspo-ray bench --suite scale`)."""
from __future__ import annotations

from gspo_ray.bench import scale


def test_every_shape_is_balanced_and_leaves_no_rank_idle():
    groups, lengths = scale.synthetic_batch(0)
    assert len(groups) == 512 and len(lengths) == 512 * 16
    assert 100 <= min(p for _, p in groups) and max(lengths) <= 2000 + 16000
    seen = set()
    for m, dp, tp, _ in scale.shapes():
        if (m.name, dp, tp) in seen:
            continue
        seen.add((m.name, dp, tp))
        mine, s = scale.layout_stats(m, groups, lengths, dp, tp)
        assert s["rows_per_rank_min"] <= len(mine) <= s["rows_per_rank_max"]  # one rank's rows: what it records
        # tokens per rank: within 10% at >= 8 prompts a rank; at 2 (DP 256) whole prompt groups are coarse units
        # and the deal evens out FLOPs, not tokens (a long row's attention costs more per token)
        if len(groups) >= 8 * dp:
            assert s["dp_imbalance"] <= 1.10, (m.name, dp, tp, s["dp_imbalance"])
        elif len(groups) >= 2 * dp:
            assert s["dp_imbalance"] <= 1.20, (m.name, dp, tp, s["dp_imbalance"])
        # attention by segment: no score matrix, what it holds beyond a flash kernel's output stays small
        assert s["busiest_rank_attention_bytes"] <= 2 * 2**30, (m.name, dp, tp, s["busiest_rank_attention_bytes"])
        if len(lengths) >= dp:
            assert s["rows_per_rank_min"] >= 1, (m.name, dp, tp)
        assert 0 <= s["slowest_rank_wait_share"] < 0.05
    assert {dp for _, dp, _ in seen} == {8, 64, 256} and any(tp == 8 for _, _, tp in seen)


def test_bytes_follow_the_model_shapes():
    smol, dense4b, a3b, _ = scale.MODELS
    # SmolLM2-135M has 134,515,008 parameters (tied embeddings): bf16 to every engine
    assert scale.weight_sync_bytes(smol)[0] == 2 * 134_515_008
    assert scale.checkpoint_bytes(smol, 1, 1, 1) == (14 * 134_515_008,) * 2
    # TP splits every matrix (the vocabulary padded to a multiple of TP); EP the experts; DP the optimizer state
    assert scale.checkpoint_bytes(dense4b, 1, 8, 1)[0] < scale.checkpoint_bytes(dense4b, 1, 1, 1)[0] / 6
    assert scale.checkpoint_bytes(a3b, 1, 1, 64)[0] < scale.checkpoint_bytes(a3b, 1, 1, 1)[0] / 10
    rank, world = scale.checkpoint_bytes(a3b, 64, 1, 8)
    one = scale.checkpoint_bytes(a3b, 1, 1, 1)[0]  # model + optimizer of the whole model (DP 1, nothing split)
    assert world == one and rank < one / 20  # each byte once: a save is the model + optimizer size, not DP x it
    lengths = [40, 7, 7, 300]
    one, many = scale.routing_store_bytes(a3b, lengths, [0, 1, 2, 3], batches=3)
    assert one == sum(lengths) * a3b.layers * a3b.top_k * 2  # int16 top-k ids per token and MoE layer
    assert many == one  # end_batch forgets a batch's records: the store holds the current batch only
    assert scale.routing_store_bytes(a3b, lengths, [3], batches=2) == (300 * a3b.layers * a3b.top_k * 2,) * 2
