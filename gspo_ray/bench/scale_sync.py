"""The scale model's weight-sync columns per transport (`rollout.weight_transfer`): the bytes each engine takes in
and each trainer rank sends per push, at every shape of bench/scale.py (docs/scale.md, "Weight sync per
transport").

What runs is the sender's real bucket plan (`trainer/weights/weight_buckets.plan_buckets`, what
`trainer/weights/weight_send. MegatronWeightSource` gathers by) over each trainer rank's Megatron shards at that TP /
EP, as meta tensors. The plan gives the model's HF bytes M (what every engine receives: vLLM's backends and ours all
feed full tensors to the model's weight loaders, which keep a worker's shard), the buckets, the largest bucket (the
sender's transient memory) and each rank's local bytes in the per-bucket gathers. Per push:

  gather     to rank 0 (nccl: only rank 0 sends): each other rank of rank 0's TP / EP groups sends its shards once,
             tp_local + ep_local bytes (Megatron puts rank 0's TP and EP groups on the same ranks at expert-TP 1);
             all-gather (ipc: every rank's GPU serves its own engine workers; shm and object_store today, through
             bridge.export_hf_weights): every rank sends (tp - 1) x tp_local + (ep - 1) x ep_local (a ring)
  nccl       rank 0 broadcasts M once to one NCCL group of all engine workers (a ring / tree broadcast: the root
             sends each byte once); each engine worker receives M over NCCL (NVLink in a node, the network across)
  ipc        no model bytes over any link: each engine worker maps M in its own GPU's memory (the trainer's gathered
             copy, CUDA IPC); rank 0 sends only the handles (and its all-gather share)
  object     rank 0 puts M into its node's object store once; each engine pulls M over the network, all from rank
  store      0's node at worst (engines on other nodes): rank 0's node sends up to engines x M
  shm        rank 0 writes M once into a memfd; each engine on its node maps it (host memory, no network); engines
             on other nodes cannot use it

Engines: `ENGINE_TP[model]` GPUs each, as many GPUs as the trainer has (dp x tp / engine TP engines; a 1:1 split,
the engines colocated on the trainer's GPUs for ipc, on GPUs of their own for nccl).
"""
from __future__ import annotations

import torch

from gspo_ray.rollout.weight_transfer import estimate_push_s
from gspo_ray.trainer.weights.bridge import param_map, shard_tp
from gspo_ray.trainer.model_spec import ModelSpec
from gspo_ray.trainer.weights.weight_buckets import GATHER_EP, GATHER_TP, WeightBucket, plan_buckets

ENGINE_TP = {"SmolLM2-135M": 1, "Qwen3-4B-like": 1, "Qwen3-30B-A3B-like": 4, "Qwen3-235B-A22B-like": 8}
TRANSPORTS = ("nccl", "ipc", "object_store", "shm")


def local_params(params: list[tuple[str, tuple[int, ...]]], spec: ModelSpec
                 ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(Megatron name, local shape, bf16) of rank 0's parameters at the spec's TP / EP, from every parameter's
    full shape (`bench/scale.megatron_params`: experts by global index): dense tensors TP-sharded by
    bridge.shard_tp, experts 0 .. num_local_experts - 1 (every rank's shapes are the same)."""
    out = []
    for name, full in params:
        pm = param_map(name, spec.arch)
        if pm.local_expert is not None:
            if pm.local_expert < spec.num_local_experts:
                out.append((name, full, torch.bfloat16))
            continue
        out.append((name, tuple(shard_tp(torch.empty(full, device="meta"), pm, spec, spec.tp, 0).shape),
                    torch.bfloat16))
    return out


def sync_plan(params: list[tuple[str, tuple[int, ...]]], spec: ModelSpec, bucket_bytes: int) -> list[WeightBucket]:
    """The sender's bucket plan at the spec's TP / EP (trainer/weights/weight_buckets.plan_buckets)."""
    return plan_buckets(local_params(params, spec), spec, bucket_bytes)


def transport_bytes(plan: list[WeightBucket], tp: int, ep: int, engines: int) -> dict[str, int]:
    """Per push: `sync_model_bytes` (M), `sync_buckets`, `sync_largest_bucket_bytes`, the busiest trainer rank's
    gather bytes to rank 0 (`sync_gather_to_rank0_bytes`: a rank of rank 0's TP and EP groups, which Megatron's
    expert layout makes the same ranks at expert-TP 1, sends its shards once) and all-gathered
    (`sync_all_gather_bytes_per_rank`: (group - 1) x its shards), and per transport `sync_<t>_engine_bytes`
    (what each engine worker, or engine for object_store, takes in) and `sync_<t>_rank0_bytes` (what trainer rank
    0 sends)."""
    model = sum(b.full_bytes for b in plan)
    tp_local = sum(b.local_bytes(GATHER_TP) for b in plan)
    ep_local = sum(b.local_bytes(GATHER_EP) for b in plan)
    all_gather = (tp - 1) * tp_local + (ep - 1) * ep_local
    # rank 0 in the gathers: nccl gathers to it (it sends nothing there); ipc all-gathers; shm and object_store
    # take bridge.export_hf_weights today, which all-gathers every parameter on every rank
    rank0 = {"nccl": model, "ipc": all_gather, "object_store": all_gather + engines * model,
             "shm": all_gather + model}
    out = {"sync_model_bytes": model, "sync_buckets": len(plan),
           "sync_largest_bucket_bytes": max(b.full_bytes for b in plan),
           "sync_gather_to_rank0_bytes": tp_local * (tp > 1) + ep_local * (ep > 1),
           "sync_all_gather_bytes_per_rank": all_gather}
    for t in TRANSPORTS:
        out[f"sync_{t}_engine_bytes"] = model
        out[f"sync_{t}_rank0_bytes"] = rank0[t]
    return out


def engines_at(model: str, dp: int, tp: int) -> int:
    """Engines of ENGINE_TP[model] GPUs on as many GPUs as the trainer's dp x tp."""
    return max(1, dp * tp // ENGINE_TP[model])


def _gb(x: float) -> str:
    return f"{x / 2**30:.2f}"


def sync_table(rows: list[dict]) -> str:
    head = ("| model | DP | TP | EP | engines x TP | buckets (largest GiB) | other rank GiB: gather to 0 | "
            "all-gather | engine GiB (every transport) | rank 0 GiB: nccl | ipc | object store | shm | "
            "push s, estimate: nccl | ipc |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['dp']} | {r['tp']} | {r['ep']} | {r['sync_engines']} x "
                     f"{r['sync_engine_tp']} | {r['sync_buckets']} ({_gb(r['sync_largest_bucket_bytes'])}) | "
                     f"{_gb(r['sync_gather_to_rank0_bytes'])} | {_gb(r['sync_all_gather_bytes_per_rank'])} | "
                     f"{_gb(r['sync_model_bytes'])} | "
                     + " | ".join(_gb(r[f"sync_{t}_rank0_bytes"]) for t in TRANSPORTS) + " | "
                     # the estimate the preflight holds rollout.push_timeout_s to (preflight/push_bound.py)
                     + " | ".join(f"{estimate_push_s(r['sync_model_bytes'], t):.0f}" for t in ("nccl", "ipc")) + " |")
    return "\n".join(lines)
