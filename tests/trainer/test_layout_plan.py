"""The memory model and the planner with context and pipeline parallelism (trainer/memory.py, trainer/layout_plan.py,
preflight/memory.refusal_line): pure functions on model shapes, no process group. What CP and PP change per rank,
term by term, against the rules the docstrings state (docs/scale.md, "Memory"); the refusal names CP / PP where
only they make a job fit."""
from __future__ import annotations

from dataclasses import replace

import pytest

from gspo_ray.preflight.memory import MemoryPlan, refusal_line
from gspo_ray.trainer.layout_plan import candidate_layouts, fitting_layouts, step_seconds
from gspo_ray.trainer.memory import (DTYPE_BYTES, GIB, Layout, MemoryShape, activation_bytes, gathered_kv_bytes,
                                     logits_bytes, pipeline_stages, rank_memory, rank_params)

QWEN3_30B = MemoryShape(name="Qwen3-30B-A3B", vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4,
                        head_dim=128, experts=128, top_k=8, moe_ffn=768, moe_layers=48, qk_norm=True)
# a dense model whose 2 kv heads cap TP at 2: only pipeline stages split its weights further
DENSE_17B = MemoryShape(name="dense-17B-like", vocab=152064, hidden=5120, layers=48, heads=40, kv_heads=2,
                        head_dim=128, ffn=17408)
TIED = MemoryShape(name="tied", vocab=1000, hidden=64, layers=6, heads=4, kv_heads=2, head_dim=16, ffn=128, tied=True)
# Qwen3-235B-A22B's 94 layers (PP 2 only) and DeepSeek-V3's 61 (no PP): the trainer builds even stages only
QWEN3_235B = replace(QWEN3_30B, name="Qwen3-235B-A22B-like", layers=94, moe_layers=94, hidden=4096, heads=64)
LAYERS_61 = replace(QWEN3_30B, name="61-layers", layers=61, moe_layers=61)


def test_pipeline_stages_hold_their_layers_and_the_embeddings_once_or_twice_when_tied():
    assert [(s.first_layer, s.layers) for s in pipeline_stages(48, 4)] == [(0, 12), (12, 12), (24, 12), (36, 12)]
    for layers, pp in ((94, 4), (61, 2), (5, 2)):  # uneven stages: refused, as trainer/model.stage_layers does
        with pytest.raises(ValueError, match=f"trainer.pp \\({pp}\\) must divide the model's {layers} layers"):
            pipeline_stages(layers, pp)
    for shape, pp, extra in ((QWEN3_30B, 4, 0), (TIED, 2, TIED.vocab * TIED.hidden), (TIED, 1, 0)):
        stages = pipeline_stages(shape.layers, pp)
        assert sum(s.layers for s in stages) == shape.layers and stages[0].first and stages[-1].last
        held = [rank_params(shape, Layout(world=pp, pp=pp), s) for s in stages]
        # every parameter on one stage; tied embeddings also on the last (Megatron's copy for the output layer)
        assert sum(d + e for d, e in held) == shape.total_params + extra
    first, *_, last = (rank_params(QWEN3_30B, Layout(world=4, pp=4), s) for s in pipeline_stages(48, 4))
    assert first[0] - last[0] == -QWEN3_30B.hidden  # the same layers; the output layer vs the embeddings + norm


def test_one_f_one_b_keeps_pp_micro_batches_on_the_first_stage_and_one_on_the_last():
    lay = Layout(world=4, pp=4, micro_batch_tokens=4096)
    stages = pipeline_stages(48, 4)
    one = activation_bytes(QWEN3_30B, replace(lay, microbatches=1), stages[0])
    assert activation_bytes(QWEN3_30B, lay, stages[0]) == 4 * one       # min(pp - 0, M) in flight
    assert activation_bytes(QWEN3_30B, replace(lay, microbatches=2), stages[0]) == 2 * one
    assert activation_bytes(QWEN3_30B, lay, stages[1]) == 3 * one       # stage 1 holds pp - 1
    # the last stage: one in flight, the final norm, the logits; the whole model's activations split in 4 stages
    whole = activation_bytes(QWEN3_30B, Layout(world=1, micro_batch_tokens=4096))
    assert activation_bytes(QWEN3_30B, lay, stages[3]) == pytest.approx(whole / 4, rel=0.01)
    assert logits_bytes(QWEN3_30B, lay, stages[0]) == 0 < logits_bytes(QWEN3_30B, lay, stages[3])
    terms = rank_memory(QWEN3_30B, lay)
    assert terms.stage == 0 and terms.terms["activations"] == 4 * one  # the busiest stage counts


def test_context_parallel_splits_activations_not_the_state_and_the_optimizer_over_dp_x_cp():
    base = Layout(world=8, tp=2, ep=8, micro_batch_tokens=32768, recompute="selective")
    cp = replace(base, cp=2)
    one, two = rank_memory(QWEN3_30B, base).terms, rank_memory(QWEN3_30B, cp).terms
    assert (base.dp, cp.dp) == (4, 2)
    # the distributed optimizer shards dense state over DP x CP (megatron-core's dp_cp group): 4 ranks either way
    for term in ("weights", "grads", "main_params", "optimizer"):
        assert two[term] == one[term], term
    gathered = gathered_kv_bytes(QWEN3_30B, cp)  # one layer's all-gathered keys and values
    assert gathered == 2 * 32768 * (4 // 2) * 128 * DTYPE_BYTES["bfloat16"]
    # selective: each layer keeps its gathered keys and values (the recomputed attention call's checkpoint inputs)
    # besides one layer's live gather
    layers = QWEN3_30B.layers
    assert two["activations"] - (layers + 1) * gathered == pytest.approx(one["activations"] / 2, rel=1e-3)
    assert two["logits"] == one["logits"] // 2
    # recompute none: every layer's attention keeps the gathered keys and values it attended (an upper bound)
    kept = activation_bytes(QWEN3_30B, replace(cp, recompute="none"))
    halved = activation_bytes(QWEN3_30B, replace(base, recompute="none")) / 2
    assert kept == pytest.approx(halved + (layers + 1) * gathered, rel=1e-3)
    # full: a layer keeps its input only and gathers again in its backward; the first 12 layers only: the rest keep
    full = activation_bytes(QWEN3_30B, replace(cp, recompute="full"))
    assert full == pytest.approx(activation_bytes(QWEN3_30B, replace(base, recompute="full")) / 2 + gathered,
                                 rel=1e-3)
    part = activation_bytes(QWEN3_30B, replace(cp, recompute="full", recompute_layers=12))
    assert part - activation_bytes(QWEN3_30B, replace(base, recompute="full", recompute_layers=12)) / 2 == \
        pytest.approx((layers - 12 + 1) * gathered, rel=1e-3)
    # CP changes no FLOP; PP adds 1F1B's bubble (M + pp - 1) / M
    batch = 32 * 16 * 33792
    assert step_seconds(QWEN3_30B, cp, batch) == step_seconds(QWEN3_30B, base, batch)
    pp = replace(base, pp=2, microbatches=8)
    assert step_seconds(QWEN3_30B, pp, batch) == pytest.approx(step_seconds(QWEN3_30B, base, batch) * 9 / 8)


def test_the_planner_offers_pp_only_where_it_divides_the_layers():
    """Every candidate's stages are ones the trainer builds (rank_memory refuses the others): 94 layers take PP 2,
    61 none."""
    for shape, pps in ((QWEN3_235B, {1, 2}), (LAYERS_61, {1}), (QWEN3_30B, {1, 2, 4, 8, 16})):
        layouts = candidate_layouts(shape, Layout(world=64, micro_batch_tokens=8192), 64)
        assert {lay.pp for lay in layouts} == pps, shape.name
    with pytest.raises(ValueError, match="pp 4 does not divide the model's 94 layers"):
        rank_memory(QWEN3_235B, Layout(world=64, pp=4))


@pytest.mark.parametrize("shape,layout,needs", [
    (QWEN3_30B, Layout(world=8, tp=2, ep=4, micro_batch_tokens=33792), "x CP "),  # 32k-token completions
    (DENSE_17B, Layout(world=8, tp=2, micro_batch_tokens=8192, dtype="float32"), "x PP "),  # no offload in fp32
])
def test_refusal_names_cp_or_pp_where_they_make_it_fit(shape, layout, needs):
    batch = 32 * 16 * layout.micro_batch_tokens
    plan = MemoryPlan(shape, layout, rank_memory(shape, layout), 80 * GIB, "trainer.device_memory_gb 80", True,
                      batch, 0.0, layout.micro_batch_tokens)
    line = refusal_line(plan)
    assert not plan.fits and "\n" not in line and needs in line.split("; fits: ")[1], line
    (best, terms), = fitting_layouts(shape, layout, layout.world, 80 * GIB, batch, 1, layout.micro_batch_tokens)
    assert best.describe() in line and terms.total <= 0.9 * 80 * GIB
    # without that axis: nothing fits on as many ranks (PP here), or only slower steps (full recompute, CP here)
    axis = "cp" if needs == "x CP " else "pp"
    others = [lay for lay, _ in fitting_layouts(shape, layout, layout.world, 80 * GIB, batch, 10 ** 5,
                                                layout.micro_batch_tokens) if getattr(lay, axis) == 1]
    assert all(step_seconds(shape, lay, batch) > step_seconds(shape, best, batch) for lay in others)
    assert (axis == "pp") == (not others)
