"""The scale model (bench/scale.py) runs the trainer's own planning code at cluster shapes: its layout meets the
balance the DP layout promises, and its byte counts are what the model shapes imply. Pure lists and meta tensors:
no weights, no process group (the whole bench, routing-record store included, is `gspo-ray bench --suite scale`)."""
from __future__ import annotations

from gspo_ray.bench import scale, scale_sync


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
        # tokens per rank within 10% at every DP, 256 included (2 prompts a rank): the deal balances tokens and
        # cost at once, and a group row above a quarter of a rank's share is split (batch_layout.deal_rows,
        # SPLIT_SHARE); dealt by cost alone this was 1.09-1.15 at DP 256
        assert s["dp_imbalance"] <= 1.10, (m.name, dp, tp, s["dp_imbalance"])
        # attention by segment: no score matrix, what it holds beyond a flash kernel's output stays small
        assert s["busiest_rank_attention_bytes"] <= 2 * 2**30, (m.name, dp, tp, s["busiest_rank_attention_bytes"])
        if len(lengths) >= dp:
            assert s["rows_per_rank_min"] >= 1, (m.name, dp, tp)
        assert 0 <= s["slowest_rank_wait_share"] < 0.06
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


def test_weight_sync_per_transport_from_the_senders_plan():
    """bench/scale_sync.py: the sender's bucket plan (trainer/weights/weight_buckets.py) at a shape's TP / EP gives the
    same model bytes as the export path's buckets, and the transports' bytes follow from it."""
    smol, dense4b, _, _ = scale.MODELS
    limit = int(scale.BUCKET_MB * 2**20)
    for m, tp in ((smol, 1), (dense4b, 1), (dense4b, 8)):
        plan = scale_sync.sync_plan(scale.megatron_params(m), scale.model_spec(m, tp, 1), limit)
        assert all(b.full_bytes <= limit or len(b.params) == 1 for b in plan)
        engines = scale_sync.engines_at(m.name, 64, tp)
        got = scale_sync.transport_bytes(plan, tp, 1, engines)
        model = scale.weight_sync_bytes(m)[0]  # the export path's HF bytes: the same model either way
        assert got["sync_model_bytes"] == model and all(got[f"sync_{t}_engine_bytes"] == model
                                                        for t in scale_sync.TRANSPORTS)
        if tp == 1:  # nothing sharded: no gather; nccl sends the model once whatever the engine count
            assert got["sync_gather_to_rank0_bytes"] == got["sync_all_gather_bytes_per_rank"] == 0
        else:  # a ring all-gather sends (tp - 1) x what a gather to rank 0 sends
            assert got["sync_all_gather_bytes_per_rank"] == (tp - 1) * got["sync_gather_to_rank0_bytes"] > 0
        assert got["sync_nccl_rank0_bytes"] == model
        assert got["sync_ipc_rank0_bytes"] == got["sync_all_gather_bytes_per_rank"]
        assert got["sync_object_store_rank0_bytes"] == engines * model + got["sync_all_gather_bytes_per_rank"]
    assert scale_sync.engines_at("Qwen3-30B-A3B-like", 8, 1) == 2  # 8 GPUs of 4-GPU engines
