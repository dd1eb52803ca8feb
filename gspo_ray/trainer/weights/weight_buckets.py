"""The bucket plan of a weight push read from Megatron's shards: which parameters travel together, gathered how.

    plan = plan_buckets([(name, tuple(p.shape), p.dtype) for name, p in params], spec, bucket_bytes=64 * 2**20)
    for bucket in plan:                                   # every trainer rank, in the same order (collective)
        pairs = gather_bucket(bucket, params_by_name, spec, tp_group, ep_group, to_root=False)  # [(HF, full)]

A bucket is a run of consecutive Megatron parameters whose full (gathered, HF) bytes stay within `bucket_bytes`
(a larger single parameter is a bucket of its own). Each bucket costs at most two collectives, whatever its
parameter count: one over the TP group of the TP-sharded parameters' local shards packed into one flat byte
buffer, and one over the EP group of the expert parameters' (a per-parameter gather, what `bridge.
export_hf_weights` does, is one collective a tensor: ~24k for a 235B-A22B-like MoE). Replicated parameters
(norms, routers, and everything at TP 1 / EP 1) are not gathered. The collective is an all-gather where every
rank needs the full tensors (vLLM's `ipc`: each rank's GPU serves its own engine workers) or a gather to the
group's first rank where only global rank 0 sends (vLLM's `nccl`): each rank then sends its shards once instead
of to every peer of its group.

Order (what vLLM's `WeightSource` contract needs: `metadata()` and iteration agree element by element): the
model's parameter order; a parameter's HF tensors in `bridge.split_to_hf` order; an expert parameter's EP ranks
in rank order (local expert j of EP rank r is global expert r * num_local_experts + j, bridge.py's layout).

Pure planning on shapes (meta tensors), so `bench/scale_sync.py` runs this same code at cluster shapes. No vLLM
here: the vLLM side is `trainer/weights/weight_send.py`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import Tensor

from gspo_ray.trainer.weights.bridge import is_lora_param, param_map, split_to_hf, unshard_tp
from gspo_ray.trainer.model_spec import ModelSpec

GATHER_TP, GATHER_EP, GATHER_NONE = "tp", "ep", "none"


@dataclass(frozen=True)
class PlannedParam:
    """One Megatron parameter in a bucket: its local shard, how it is gathered, the HF tensors it becomes."""

    name: str
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    gather: str                                    # GATHER_TP | GATHER_EP | GATHER_NONE
    hf: tuple[tuple[str, tuple[int, ...]], ...]    # (HF name, full shape), in the order they are yielded

    @property
    def local_bytes(self) -> int:
        return torch.Size(self.local_shape).numel() * self.dtype.itemsize

    @property
    def full_bytes(self) -> int:
        return sum(torch.Size(shape).numel() for _, shape in self.hf) * self.dtype.itemsize


@dataclass(frozen=True)
class WeightBucket:
    """Parameters gathered together: at most one TP all-gather and one EP all-gather."""

    params: tuple[PlannedParam, ...]

    @property
    def full_bytes(self) -> int:
        """The HF bytes this bucket yields (what each engine receives of it)."""
        return sum(p.full_bytes for p in self.params)

    def local_bytes(self, gather: str) -> int:
        """This rank's bytes packed into the `gather` ("tp" / "ep") all-gather."""
        return sum(p.local_bytes for p in self.params if p.gather == gather)


def _hf_outputs(name: str, local_shape: tuple[int, ...], spec: ModelSpec) -> tuple[str, tuple]:
    """(gather kind, ((HF name, full shape), ...)) of one Megatron parameter, from its local shape (meta)."""
    pm = param_map(name, spec.arch)
    local = torch.empty(local_shape, device="meta")
    if pm.local_expert is not None:
        ranks = spec.ep
        out = tuple((hf, tuple(t.shape)) for r in range(ranks)
                    for hf, t in zip(pm.for_expert(r * spec.num_local_experts + pm.local_expert),
                                     split_to_hf(local, pm.merge, spec)))
        return (GATHER_EP if ranks > 1 else GATHER_NONE), out
    sharded = pm.shard != "none" and spec.tp > 1
    full = unshard_tp([local] * (spec.tp if sharded else 1), pm, spec)  # drops vocabulary padding at any TP
    out = tuple((hf, tuple(t.shape)) for hf, t in zip(pm.hf_names, split_to_hf(full, pm.merge, spec)))
    return (GATHER_TP if sharded else GATHER_NONE), out


def plan_buckets(params: Iterable[tuple[str, tuple[int, ...], torch.dtype]], spec: ModelSpec,
                 bucket_bytes: int) -> list[WeightBucket]:
    """Consecutive parameters (name, local shape, dtype; LoRA adapters skipped) into buckets of at most
    `bucket_bytes` full HF bytes each (a single larger parameter alone). Every parameter lands in exactly one
    bucket, in the given order."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[WeightBucket] = []
    current: list[PlannedParam] = []
    size = 0
    for name, shape, dtype in params:
        if is_lora_param(name):  # the base weights only (merged pushes fold adapters in first)
            continue
        gather, hf = _hf_outputs(name, tuple(shape), spec)
        p = PlannedParam(name, tuple(shape), dtype, gather, hf)
        if current and size + p.full_bytes > bucket_bytes:
            buckets.append(WeightBucket(tuple(current)))
            current, size = [], 0
        current.append(p)
        size += p.full_bytes
    if current:
        buckets.append(WeightBucket(tuple(current)))
    return buckets


def _pack(tensors: list[Tensor]) -> Tensor:
    """Local shards as one flat byte buffer (any dtypes; one collective moves them all)."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def _unpack(flat: Tensor, params: list[PlannedParam]) -> list[Tensor]:
    """Inverse of `_pack` for one rank's buffer: owned tensors of each parameter's local shape and dtype."""
    out, offset = [], 0
    for p in params:
        # a copy: fresh storage is aligned for any dtype (a bf16 tensor of odd size shifts what follows it)
        out.append(flat[offset:offset + p.local_bytes].clone().view(p.dtype).reshape(p.local_shape))
        offset += p.local_bytes
    return out


def torch_collect(t: Tensor, group, to_root: bool) -> list[Tensor] | None:
    """Every rank's `t` over `group`, in rank order: on every rank (all-gather), or with to_root on global rank 0
    only (a gather to it; None on the others, which send their buffer once instead of to every peer; a group
    without rank 0 skips the collective, nobody needs its result)."""
    dist = torch.distributed
    n = dist.get_world_size(group)
    if not to_root:
        out = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(out, t, group=group)
        return out
    if 0 not in dist.get_process_group_ranks(group):
        return None
    root = 0
    out = [torch.empty_like(t) for _ in range(n)] if dist.get_rank() == root else None
    dist.gather(t, out, dst=root, group=group)
    return out


Collect = Callable[[Tensor, object, bool], "list[Tensor] | None"]


def gather_bucket(bucket: WeightBucket, tensors: dict[str, Tensor], spec: ModelSpec, tp_group=None, ep_group=None,
                  to_root: bool = False, collect: Collect = torch_collect) -> list[tuple[str, Tensor | None]]:
    """(HF name, full tensor) of every parameter of `bucket`, in plan order, from this rank's shards `tensors`
    (Megatron name -> local tensor). Collective over the TP and EP groups: every rank of them calls it for the
    same bucket. The tensors are owned copies, never views of parameters the optimizer will change.

    to_root: the sharded parameters are gathered to global rank 0 (vLLM's sender) only, over its TP and EP groups;
    elsewhere their tensors are None (vLLM's convention for a parameter a rank does not hold). Each rank of rank
    0's groups then sends its shards once, not (group size - 1) times, and other groups send nothing."""
    gathered: dict[str, list[Tensor] | None] = {}
    for kind, group in ((GATHER_TP, tp_group), (GATHER_EP, ep_group)):
        params = [p for p in bucket.params if p.gather == kind]
        if not params:
            continue
        per_rank = collect(_pack([tensors[p.name] for p in params]), group, to_root)
        shards = None if per_rank is None else [_unpack(flat, params) for flat in per_rank]
        for i, p in enumerate(params):
            gathered[p.name] = None if shards is None else [rank_shards[i] for rank_shards in shards]
    out: list[tuple[str, Tensor | None]] = []
    for p in bucket.params:
        pm = param_map(p.name, spec.arch)
        if p.name in gathered and gathered[p.name] is None:  # gathered to another rank
            out += [(hf_name, None) for hf_name, _ in p.hf]
            continue
        owned = p.name in gathered  # gathered shards are fresh buffers; a replicated one is the parameter itself
        shards = gathered[p.name] if owned else [tensors[p.name].detach()]
        if pm.local_expert is not None:
            pieces = [t for shard in shards for t in split_to_hf(shard, pm.merge, spec)]
        else:
            pieces = split_to_hf(unshard_tp(shards, pm, spec), pm.merge, spec)
        for (hf_name, shape), t in zip(p.hf, pieces, strict=True):
            if tuple(t.shape) != shape:
                raise ValueError(f"{p.name}: gathered {hf_name} has shape {tuple(t.shape)}, the plan says {shape}")
            out.append((hf_name, t.contiguous() if owned else t.clone(memory_format=torch.contiguous_format)))
    return out
