"""The plan: the cheapest trainer layouts over TP, EP, CP, PP, recompute, micro-batch size and optimizer offload that
fit a device (`gspo-ray plan`, the preflight's refusal, the scale model's memory rows).

    fits = fitting_layouts(shape, base, world=16, device_bytes=80 * GIB, batch_tokens=..., min_tokens=18432)
    layout, terms = fits[0]                     # the cheapest that fits; terms: trainer/memory.rank_memory

Candidates (`candidate_layouts`): TP 1-8 dividing the heads and kv heads, CP 1-8, TP x CP within a node (8 GPUs:
both run collectives every layer, TP's on every linear, CP's all-gather of keys and values, and need NVLink), EP
dividing the experts, PP 1-16 (dividing the layers: even stages; across nodes, point-to-point only), TP x CP x PP and EP x PP
dividing the ranks (Megatron's rank layout, expert-TP 1), CP or PP but not both (trainer.cp and trainer.pp > 1
together are refused: never tested), each recompute, micro_batch_tokens halved down to an
eighth of the configured and one sequence (`min_tokens`: a sequence is never split over micro-batches; CP splits
it over ranks instead), optimizer offload and bf16 gradient buffers in bf16.

The rule (`layout_cost`): the shortest predicted step first (`step_seconds`: the FLOPs of forward, backward and
recompute over every rank, times 1F1B's bubble (M + PP - 1) / M at M micro-batches a DP rank); among equal steps the
least rounding and communication: fp32 gradient buffers (bf16 ones round every micro-batch's gradient into the
sum: trainer.grad_reduce_in_fp32 false, tried in a bf16 model only), no optimizer offload (its host copies and CPU step are not in the step), then the fewest
pipeline stages, then the least CP (a key/value all-gather a layer), then the least TP (collectives a layer,
within a node), then larger micro-batches, then the least EP. So TP is raised before CP and CP before PP where the
step is the same; recompute costs a forward (full) or a third of one (selective) and loses to CP or PP wherever
those fit without it. Communication time itself is not predicted.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from gspo_ray.trainer.memory import RECOMPUTE, Layout, MemoryShape, MemoryTerms, rank_memory

# The share of a device the terms may fill: the CUDA context, NCCL's buffers and the caching allocator's
# fragmentation are not among them
USABLE_SHARE = 0.9
PEAK_FLOPS = 989e12  # H100 SXM bf16 dense, the scale model's (bench/scale.py)
MFU = 0.4
NODE_GPUS = 8                      # TP x CP within a node: their collectives run every layer, over NVLink
TP_SIZES = CP_SIZES = (1, 2, 4, 8)
PP_SIZES = (1, 2, 4, 8, 16)
EP_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def active_matrix_params(shape: MemoryShape) -> int:
    """Matrix parameters a token passes through in the layers (attention, the dense or the top-k experts' MLP)."""
    h = shape.hidden
    dense_layers = shape.layers - shape.moe_layers
    attn = shape.dense_layer_params - 2 * h
    return (shape.layers * attn + dense_layers * 3 * h * shape.ffn
            + shape.moe_layers * 3 * h * (shape.top_k * shape.moe_ffn + shape.shared_ffn))


def microbatches(layout: Layout, batch_tokens: int) -> int:
    """Micro-batches a DP rank runs a step: layout.microbatches, else its share of the step's tokens over
    micro_batch_tokens (the CP ranks of a DP rank share its micro-batches)."""
    if layout.microbatches is not None:
        return layout.microbatches
    return max(1, math.ceil(batch_tokens / layout.dp / layout.micro_batch_tokens))


def step_seconds(shape: MemoryShape, layout: Layout, batch_tokens: int, attention_pairs: float = 0.0) -> float:
    """The scale model's step time (bench/scale.py: fwd + bwd = 3 x forward; forward = 2 x active matrix
    parameters a token + 4 d per query-key pair and layer; split over the world's ranks, TP, CP and PP included,
    at PEAK_FLOPS x MFU), plus one more forward for recomputed layers (full) or a third of one (selective: the
    attention and dense MLPs are most of a layer's FLOPs, their recompute is one forward of those), times 1F1B's
    bubble (M + PP - 1) / M (M: microbatches)."""
    fwd = 2 * active_matrix_params(shape) * batch_tokens + 4 * shape.layers * shape.heads * shape.head_dim * \
        attention_pairs
    passes = 3.0
    if layout.recompute == "full":
        share = 1.0 if layout.recompute_layers is None else min(layout.recompute_layers, shape.layers) / shape.layers
        passes += share
    elif layout.recompute == "selective":
        passes += 1 / 3
    m = microbatches(layout, batch_tokens)
    return passes * fwd / layout.world / (PEAK_FLOPS * MFU) * (m + layout.pp - 1) / m


def candidate_layouts(shape: MemoryShape, base: Layout, world: int, min_tokens: int = 1,
                      batch_tokens: int | None = None, bf16_grads: bool = True) -> list[Layout]:
    """Layouts over `world` ranks the trainer can build (see the module docstring); with batch_tokens each gets
    its micro-batches a DP rank (1F1B's in-flight bound). bf16_grads False: bf16 gradient buffers are not tried."""
    out = []
    tps = [t for t in TP_SIZES if world % t == 0 and shape.kv_heads % t == 0 and shape.heads % t == 0]
    eps = [e for e in EP_SIZES if world % e == 0 and (shape.experts % e == 0 if shape.experts else e == 1)]
    tokens = [base.micro_batch_tokens // 2 ** k for k in range(4) if base.micro_batch_tokens // 2 ** k >= min_tokens]
    if min_tokens < base.micro_batch_tokens and min_tokens not in tokens:
        tokens.append(min_tokens)  # one sequence a micro-batch
    tokens = tokens or [base.micro_batch_tokens]
    offloads = (False, True) if base.offload or base.dtype != "float32" else (False,)
    # bf16 gradient buffers: tried in a bf16 model (the planner says so: trainer.grad_reduce_in_fp32 false)
    grad_buffers = (True, False) if bf16_grads and base.dtype != "float32" and base.grads_fp32 else (base.grads_fp32,)
    for tp in tps:
        for cp in (c for c in CP_SIZES if tp * c <= NODE_GPUS):
            for pp in (p for p in PP_SIZES if shape.layers % p == 0):  # even stages (memory.stage_layer_range)
                if world % (tp * cp * pp) or cp > 1 and pp > 1:  # the trainer builds CP and PP, not both at once
                    continue
                for ep in (e for e in eps if world % (e * pp) == 0):
                    for recompute in RECOMPUTE:
                        for mbt in tokens:
                            for offload in offloads:
                                for grads_fp32 in grad_buffers:
                                    layout = replace(base, world=world, tp=tp, ep=ep, cp=cp, pp=pp,
                                                     recompute=recompute, micro_batch_tokens=mbt, offload=offload,
                                                     grads_fp32=grads_fp32,
                                                     distributed_optimizer=None if base.distributed_optimizer is None
                                                     else base.distributed_optimizer or offload)
                                    if batch_tokens is not None:
                                        layout = replace(layout, microbatches=microbatches(layout, batch_tokens))
                                    out.append(layout)
    return out


def layout_cost(shape: MemoryShape, layout: Layout, batch_tokens: int, attention_pairs: float = 0.0) -> tuple:
    """What "cheapest" means (the module docstring's rule): the predicted step seconds, then fp32 gradient buffers,
    no offload, fewer PP stages, less CP, less TP, fewer micro-batches, less EP."""
    return (round(step_seconds(shape, layout, batch_tokens, attention_pairs), 6), layout.bf16_grads, layout.offload,
            layout.pp,
            layout.cp, layout.tp, -layout.micro_batch_tokens, layout.ep)


def fitting_layouts(shape: MemoryShape, base: Layout, world: int, device_bytes: int, batch_tokens: int,
                    limit: int = 5, min_tokens: int = 1, attention_pairs: float = 0.0, bf16_grads: bool = True,
                    accepts: Callable[[Layout], bool] | None = None) -> list[tuple[Layout, MemoryTerms]]:
    """The cheapest `limit` layouts over `world` ranks whose busiest rank fits USABLE_SHARE of `device_bytes`
    (layout_cost). accepts: whether the job could run at a layout beyond its shape (the job's config and model
    checks: preflight/memory.job_layout_check); None: every candidate."""
    fits = []
    for layout in candidate_layouts(shape, base, world, min_tokens, batch_tokens, bf16_grads):
        if accepts is not None and not accepts(layout):
            continue
        terms = rank_memory(shape, layout)
        if terms.total <= USABLE_SHARE * device_bytes:
            fits.append((layout, terms))
    fits.sort(key=lambda lt: layout_cost(shape, lt[0], batch_tokens, attention_pairs))
    return fits[:limit]


def least_memory(shape: MemoryShape, base: Layout, world: int, min_tokens: int = 1,
                 batch_tokens: int | None = None, bf16_grads: bool = True) -> tuple[Layout, MemoryTerms]:
    """The candidate layout whose busiest rank holds the least (what a shape that fits nowhere reaches)."""
    return min(((lay, rank_memory(shape, lay)) for lay in candidate_layouts(shape, base, world, min_tokens,
                                                                            batch_tokens, bf16_grads)),
               key=lambda lt: lt[1].total)
