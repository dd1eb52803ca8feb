"""The scale model: our own planning code at cluster shapes, no weights, no GPUs (`gspo-ray bench --suite scale`).

    python -m gspo_ray.bench.scale          # writes runs/bench/scale.json, prints the table (docs/scale.md)

What runs is the trainer's real code, imported, never restated:
  * the DP layout: batch_layout.plan_ranks (group rows planned, dealt to ranks by cost and tokens, packed per
    rank into micro-batches of micro_batch_tokens real tokens, packed rows being the trainer's default) on
    synthetic mini-batches (the same on every rank);
  * the routing-record store: routing/records.RecordStore fed with the busiest rank's rows of 64 batches the way
    the training loop feeds it, `end_batch` after each (`routing_store_bytes`: one small function, the only place
    that knows the store's API);
  * the weight-sync bucket plan: rollout/weight_sync.iter_buckets over the HF tensors the trainer exports
    (bridge.param_map / split_to_hf) as shape-only (meta) tensors; per transport (nccl, ipc, object store, shm),
    the sender's plan over each rank's Megatron shards (trainer/weights/weight_buckets.plan_buckets;
    bench/scale_sync.py: the `sync_*` keys);
  * the checkpoint shards: each rank saves its own TP / EP shard (bridge.shard_tp; experts split over EP), in the
    training dtype, plus the optimizer's fp32 main weights and two Adam moments.

Batches: 512 prompts x 16 samples, long-tailed lengths (log-normal, seeded): prompts 100-2k tokens, completions
50-16k. The micro-batch settings are a long-context job's: micro_batch_size 64, micro_batch_tokens 32768 (a
packed row of up to 32,768 real tokens per micro-batch; padded, one row of the longest sequence, ~18k tokens).

Per shape (keys as named): dp_imbalance (the busiest rank's forwarded tokens over the mean, padding and dummies
included: the trainer's train/dp_imbalance), rows_per_rank_min / _max (completions), busiest_rank_attention_bytes
(`attention_bytes`' transient part: what attention by segment holds beyond a flash kernel's output, for the
busiest rank's micro-batches, the largest) and busiest_rank_activation_bytes (the largest micro-batch: bf16
activations without recompute after Korthikanti et al. 2022, 34 s h bytes per token and layer, split over TP with
sequence parallelism, plus the flash outputs kept and the attention's transient bytes; that paper's 5 a s^2 score
term is gone with the score matrix), group_rows_split_for_width (prompt groups wider than one
micro-batch's tokens, split into several group rows; attention splits none),
routing_record_bytes_per_rank (after 64 batches; MoE only), weight_sync_bytes_per_engine (bf16), checkpoint_bytes_
per_rank and _per_save (the busiest rank's and the whole world's bytes, each byte written once with the distributed
optimizer), slowest_rank_wait_share (1 - mean / max of the ranks' step FLOPs: fwd + bwd = 3 x forward, the forward
2 x active matrix parameters per token plus 4 d per query-key pair (GroupRow.pairs) and layer;
busiest_rank_step_s gives the seconds at PEAK_FLOPS x MFU).
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gspo_ray.bench.scale_sync import ENGINE_TP, engines_at, sync_plan, sync_table, transport_bytes
from gspo_ray.rollout.weight_sync import iter_buckets
from gspo_ray.trainer.batch_layout import attention_score_weight, packed_budget, padded_budget, plan_ranks
from gspo_ray.trainer.group_rows import GroupRow
from gspo_ray.trainer.weights.bridge import param_map, shard_tp, split_to_hf
from gspo_ray.trainer.model_spec import ModelSpec

PEAK_FLOPS = 989e12  # H100 SXM bf16 dense
MFU = 0.4
PROMPTS, GROUP = 512, 16
MICRO_BATCH_SIZE, MICRO_BATCH_TOKENS = 64, 32768
BATCHES = 64  # routing records: batches fed through the store
BUCKET_MB = 64.0  # trainer.export_bucket_mb's default
OUT = Path("runs/bench/scale.json")
DP_SIZES, TP_SIZES, EP_SIZES = (8, 64, 256), (1, 8), (1, 8, 64)


@dataclass(frozen=True)
class Shape:
    """A model's shape (the HF config fields the planning and the bridge read)."""

    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int = 0          # dense MLP width (0: every layer is MoE)
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    tied: bool = False
    qk_norm: bool = True  # Qwen3's per-head q / k RMSNorm (Llama's SmolLM2 has none)

    @property
    def attn_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def ffn_active(self) -> int:
        return self.moe_ffn * self.top_k if self.experts else self.ffn

    @property
    def active_matrix_params(self) -> int:
        """Matrix parameters a token passes through in the layers (q, k, v, o and the active MLP)."""
        qkvo = self.hidden * (2 * self.attn_dim + 2 * self.kv_heads * self.head_dim)
        return self.layers * (qkvo + 3 * self.hidden * self.ffn_active)


MODELS = (
    Shape("SmolLM2-135M", 49152, 576, 30, 9, 3, 64, ffn=1536, tied=True, qk_norm=False),
    Shape("Qwen3-4B-like", 151936, 2560, 36, 32, 8, 128, ffn=9728, tied=True),
    Shape("Qwen3-30B-A3B-like", 151936, 2048, 48, 32, 4, 128, experts=128, top_k=8, moe_ffn=768),
    Shape("Qwen3-235B-A22B-like", 151936, 4096, 94, 64, 4, 128, experts=128, top_k=8, moe_ffn=1536),
)


def synthetic_batch(seed: int = 0) -> tuple[list[tuple[list[int], int]], list[int]]:
    """(groups as (rows, shared prefix), row lengths) of PROMPTS x GROUP samples with long-tailed lengths:
    prompts log-normal around 400 tokens in [100, 2000], completions log-normal around 1200 in [50, 16000]."""
    rng = random.Random(seed)
    groups, lengths = [], []
    for _ in range(PROMPTS):
        p = int(min(2000, max(100, rng.lognormvariate(math.log(400), 0.8))))
        rows = list(range(len(lengths), len(lengths) + GROUP))
        lengths += [p + int(min(16000, max(50, rng.lognormvariate(math.log(1200), 1.1)))) for _ in rows]
        groups.append((rows, p))
    return groups, lengths


def attention_bytes(shape: Shape, pack: list[GroupRow], tp: int) -> tuple[int, int]:
    """(transient, kept) bytes of attention by segment (trainer/attention/segment_attention.py) for one micro-batch of
    group rows `pack`, heads split over TP, bf16. No score matrix exists (the flash kernels work block by block).
    transient: one call at a time, the largest completion call's gathered keys and values [prefix ; segment]
    (2 x 2 x kv_heads x head_dim bytes a key) and its lower-right causal mask (c (P + c) bools, CPU only); the
    backward recomputes that call and holds the same again. kept, all layers, from forward to backward: what a
    flash kernel keeps for its backward, the output (2 x heads x head_dim bytes a query) and the fp32 log-sum-exp
    (4 x heads), for the calls not recomputed (prefixes and plain rows; completion calls keep nothing)."""
    kv = 4 * max(shape.kv_heads // tp, 1) * shape.head_dim
    transient = max((kv * (u.prefix + c) + c * (u.prefix + c) for u in pack for c in u.segments if c), default=0)
    kept = shape.layers * (2 * shape.attn_dim + 4 * shape.heads) * sum(u.prefix for u in pack) // tp
    return 2 * transient, kept


def split_for_width(groups, lengths, packed: bool = True) -> int:
    """Prompt groups wider than one micro-batch's tokens (batch_layout.packed_budget: micro_batch_tokens real
    tokens; padded: padded_budget, R x L), which the planner splits into several group rows, each with its own copy
    of the prompt (before any split to balance DP); attention splits none."""
    cap = (packed_budget if packed else padded_budget)(max(lengths), MICRO_BATCH_SIZE, MICRO_BATCH_TOKENS).tokens
    return sum(1 for rows, p in groups if p + sum(lengths[r] - p for r in rows) > cap)


def layout_stats(shape: Shape, groups, lengths, dp: int, tp: int, packed: bool = True) -> dict:
    """plan_ranks at DP dp (width padded to a multiple of tp, sequence parallelism), per-rank work and memory;
    packed: each micro-batch one packed row (trainer.packed_rows, the default), else padded rows."""
    weight = attention_score_weight(shape.hidden, shape.attn_dim, shape.ffn_active)
    plan = plan_ranks(groups, lengths, dp, MICRO_BATCH_SIZE, MICRO_BATCH_TOKENS, weight, packed=packed)
    forwards = max(len(p) for p in plan)
    dummy = GroupRow((0,), lengths[0], (0,))  # a dummy is one fully masked copy of row 0
    tokens, flops, rows, peak_act, peak_att = [], [], [], 0, 0
    for packs in plan:
        t = f = 0.0
        for pack in packs + [None] * (forwards - len(packs)):
            pack = pack or [dummy]
            if packed:  # one row of the group rows one after another, its width a multiple of TP
                r, w = 1, -(-sum(u.length for u in pack) // tp) * tp
            else:  # a row per group row, each as wide as the longest
                r, w = len(pack), -(-max(u.length for u in pack) // tp) * tp
            t += r * w
            pairs = sum(u.pairs for u in pack)
            f += 3 * (2 * shape.active_matrix_params * r * w + 4 * shape.layers * shape.attn_dim * pairs) / tp
            att, kept = attention_bytes(shape, pack, tp)
            peak_att = max(peak_att, att)
            peak_act = max(peak_act, 34 * shape.hidden * r * w * shape.layers // tp + kept + att)
        tokens.append(t)
        flops.append(f)
        rows.append(sum(len(u.rows) for pack in packs for u in pack))
    mine = max(([r for pack in packs for u in pack for r in u.rows] for packs in plan),
               key=lambda rs: sum(lengths[r] for r in rs))  # the rank with the most tokens to record
    return mine, {"dp_imbalance": max(tokens) / (sum(tokens) / dp), "rows_per_rank_min": min(rows),
            "rows_per_rank_max": max(rows), "busiest_rank_attention_bytes": peak_att,
            "busiest_rank_activation_bytes": peak_act, "slowest_rank_wait_share": 1 - sum(flops) / dp / max(flops),
            "busiest_rank_step_s": max(flops) / (PEAK_FLOPS * MFU), "micro_batches_per_rank": forwards,
            "group_rows_split_for_width": split_for_width(groups, lengths, packed)}


def megatron_params(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(Megatron name, full TP=1 shape) of every parameter (experts by global index under local_experts)."""
    h, d, kv = shape.hidden, shape.head_dim, shape.kv_heads
    out = [("embedding.word_embeddings.weight", (shape.vocab, h)), ("decoder.final_layernorm.weight", (h,))]
    if not shape.tied:
        out.append(("output_layer.weight", (shape.vocab, h)))
    for i in range(shape.layers):
        p = f"decoder.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "self_attention.linear_qkv.weight", ((shape.heads + 2 * kv) * d, h)),
                (p + "self_attention.linear_proj.weight", (h, shape.attn_dim)), (p + "pre_mlp_layernorm.weight", (h,))]
        if shape.qk_norm:
            out += [(p + "self_attention.q_layernorm.weight", (d,)), (p + "self_attention.k_layernorm.weight", (d,))]
        if not shape.experts:
            out += [(p + "mlp.linear_fc1.weight", (2 * shape.ffn, h)), (p + "mlp.linear_fc2.weight", (h, shape.ffn))]
            continue
        out.append((p + "mlp.router.weight", (shape.experts, h)))
        for e in range(shape.experts):
            out += [(p + f"mlp.experts.local_experts.{e}.linear_fc1.weight", (2 * shape.moe_ffn, h)),
                    (p + f"mlp.experts.local_experts.{e}.linear_fc2.weight", (h, shape.moe_ffn))]
    return out


def model_spec(shape: Shape, tp: int, ep: int) -> ModelSpec:
    padded = -(-shape.vocab // tp) * tp
    return ModelSpec(arch="qwen3_moe" if shape.experts else "qwen3" if shape.qk_norm else "llama", hf_config={}, hf_dir="", vocab_size=shape.vocab,
                     padded_vocab_size=padded, num_layers=shape.layers, hidden_size=shape.hidden,
                     num_heads=shape.heads, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                     ffn_hidden_size=shape.ffn, num_experts=shape.experts, moe_ffn_hidden_size=shape.moe_ffn,
                     top_k=shape.top_k, qk_norm=shape.qk_norm, tied_embeddings=shape.tied, tp=tp, ep=ep,
                     dtype=torch.bfloat16)


def weight_sync_bytes(shape: Shape) -> tuple[int, int]:
    """(bytes, buckets) of one weight push to one engine: the HF tensors the trainer exports (bf16), bucketed by
    rollout/weight_sync.iter_buckets."""
    spec = model_spec(shape, 1, 1)

    def hf_tensors():
        for name, full in megatron_params(shape):
            pm = param_map(name, spec.arch)
            meta = torch.empty(full, dtype=torch.bfloat16, device="meta")
            names = pm.for_expert(pm.local_expert) if pm.local_expert is not None else pm.hf_names
            yield from zip(names, split_to_hf(meta, pm.merge, spec))

    buckets = list(iter_buckets(hf_tensors(), BUCKET_MB))
    return sum(t.numel() * t.element_size() for b in buckets for _, t in b), len(buckets)


def checkpoint_bytes(shape: Shape, dp: int, tp: int, ep: int) -> tuple[int, int]:
    """(bytes the busiest rank writes, bytes the whole world writes) per checkpoint in bf16 training with the
    distributed optimizer (the default above DP 1), as trainer/checkpoints/shards.py lays a checkpoint out: a model
    tensor once, by the first DP rank of its TP shard (dense; bridge.shard_tp) or EP group (experts), 2 bytes a
    parameter; the optimizer's fp32 main weights and two Adam moments (12 bytes a parameter) by the DP rank that updates
    them, dense state split over the dp ranks of a TP shard, expert state over the dp * tp / ep ranks of an EP group.
    Rank 0 writes both kinds. The per-rank RNG states (~10 KB) are left out."""
    spec = model_spec(shape, tp, ep)
    dense = experts = total = 0
    for name, full in megatron_params(shape):
        pm = param_map(name, spec.arch)
        total += torch.Size(full).numel()
        if pm.local_expert is not None:
            if pm.local_expert < spec.num_local_experts:  # rank 0 of the EP group holds experts 0 .. local - 1
                experts += torch.Size(full).numel()
            continue
        dense += shard_tp(torch.empty(full, device="meta"), pm, spec, tp, 0).numel()
    rank0 = 2 * (dense + experts) + 12 * dense // dp + 12 * experts // max(1, dp * tp // ep)
    return rank0, 14 * total


def routing_store_bytes(shape: Shape, lengths: list[int], mine: list[int], batches: int = BATCHES) -> tuple[int, int]:
    """(bytes held during the first batch, bytes held during batch `batches`) in one rank's routing-record store
    (routing/records.RecordStore, the store Routing Replay, drift and the noise probe share), fed the way the
    training loop feeds it: each batch's first forward records the rows this rank forwards (`mine`: int16
    [length, top_k] per MoE layer), and the loop's `end_batch` forgets them when the batch's passes are done. At one
    pass x one mini-batch no record moves between ranks (`RecordStore.fetch` moves a record only to a rank that
    forwards its row later), so a rank holds exactly its own rows'. Records are shape-only (meta) tensors. The
    only function here that knows the store's API."""
    from gspo_ray.trainer.routing.records import RecordStore

    store = RecordStore(shape.layers)
    record = {n: torch.empty((n, shape.top_k), dtype=torch.int16, device="meta") for n in {lengths[r] for r in mine}}
    sizes = []
    for version in range(batches):
        for r in mine:  # what the router hooks store on the recording forward, layer by layer
            for layer in range(shape.layers):
                store.record(f"b{version}/{r}", layer, record[lengths[r]])
        if version in (0, batches - 1):
            sizes.append(store.nbytes())
        store.end_batch()
    return sizes[0], sizes[-1]


def shapes():
    """(model, dp, tp, ep) where they divide: tp divides the kv heads, ep the experts and dp x tp (dense: ep 1)."""
    for m in MODELS:
        for dp in DP_SIZES:
            for tp in TP_SIZES:
                if m.kv_heads % tp:
                    continue
                for ep in EP_SIZES if m.experts else (1,):
                    if (m.experts and m.experts % ep) or (dp * tp) % ep:
                        continue
                    yield m, dp, tp, ep


def sync_columns(m: Shape, dp: int, tp: int, ep: int, plans: dict) -> dict:
    """The weight-sync columns per transport at this shape (bench/scale_sync.py); `plans` caches the sender's
    bucket plan per (model, tp, ep)."""
    if (m.name, tp, ep) not in plans:
        plans[(m.name, tp, ep)] = sync_plan(megatron_params(m), model_spec(m, tp, ep), int(BUCKET_MB * 2**20))
    engines = engines_at(m.name, dp, tp)
    return {"sync_engines": engines, "sync_engine_tp": ENGINE_TP[m.name],
            **transport_bytes(plans[(m.name, tp, ep)], tp, ep, engines)}


def run_scale_bench(out: Path = OUT, seed: int = 0) -> list[dict]:
    t0 = time.perf_counter()
    groups, lengths = synthetic_batch(seed)
    rows, layouts, syncs, stores, plans = [], {}, {}, {}, {}
    for m, dp, tp, ep in shapes():
        if (m.name, dp, tp) not in layouts:
            mine, layouts[(m.name, dp, tp)] = layout_stats(m, groups, lengths, dp, tp)
            stores[(m.name, dp, tp)] = routing_store_bytes(m, lengths, mine) if m.experts else (0, 0)
        if m.name not in syncs:
            syncs[m.name] = weight_sync_bytes(m)
        rows.append({"model": m.name, "dp": dp, "tp": tp, "ep": ep, "groups": PROMPTS, "rows": len(lengths),
                     **layouts[(m.name, dp, tp)],
                     "routing_record_bytes_per_rank": stores[(m.name, dp, tp)][1],
                     "routing_record_bytes_one_batch": stores[(m.name, dp, tp)][0],
                     "weight_sync_bytes_per_engine": syncs[m.name][0], "weight_sync_buckets": syncs[m.name][1],
                     **dict(zip(("checkpoint_bytes_per_rank", "checkpoint_bytes_per_save"),
                                checkpoint_bytes(m, dp, tp, ep))),
                     **sync_columns(m, dp, tp, ep, plans)})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(scale_table(rows))
    print("\nWeight sync per transport (one push; GiB):\n" + sync_table(rows))
    print(f"\n{len(rows)} shapes in {time.perf_counter() - t0:.0f} s; {sum(lengths) / 1e6:.1f}M tokens a batch "
          f"({len(lengths)} rows); wrote {out}")
    return rows


def _gb(x: float) -> str:
    return f"{x / 2**30:.2f}"


def scale_table(rows: list[dict]) -> str:
    head = ("| model | DP | TP | EP | dp_imbalance | rows/rank min-max | wait share | step s | attention GiB | "
            "activation GiB | routing records GiB (1 batch -> 64) | weight sync GiB | checkpoint GiB/rank | "
            "checkpoint GiB/save |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        rec = (f"{_gb(r['routing_record_bytes_one_batch'])} -> {_gb(r['routing_record_bytes_per_rank'])}"
               if r["routing_record_bytes_per_rank"] else "-")
        lines.append(f"| {r['model']} | {r['dp']} | {r['tp']} | {r['ep']} | {r['dp_imbalance']:.3f} | "
                     f"{r['rows_per_rank_min']}-{r['rows_per_rank_max']} | {r['slowest_rank_wait_share']:.3f} | "
                     f"{r['busiest_rank_step_s']:.1f} | {_gb(r['busiest_rank_attention_bytes'])} | "
                     f"{_gb(r['busiest_rank_activation_bytes'])} | {rec} | "
                     f"{_gb(r['weight_sync_bytes_per_engine'])} | {_gb(r['checkpoint_bytes_per_rank'])} | "
                     f"{_gb(r['checkpoint_bytes_per_save'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    run_scale_bench()
