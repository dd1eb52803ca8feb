"""The trainer side of pushes through vLLM's CUDA backends, on CPU: the bucket plan (trainer/weights/weight_buckets.py)
and `MegatronWeightSource` (trainer/weights/weight_send.py, vLLM's `WeightSource`).

The gathers run for real between threads (one thread per trainer rank, a barrier-backed all-gather standing in
for torch.distributed's over the TP and EP groups), on a tiny MoE sharded TP 2 x EP 2 by the bridge's own
`shard_tp` and expert layout: every rank yields exactly the HF tensors of the unsharded model, in `metadata()`
order, checked by vLLM's own `WeightSource.iter_groups` (which raises when iteration and metadata disagree).

With trainer.lora merged pushes the source reads `MergedView` (trainer/lora/peft_io.py): on a tiny bf16 MoE with
adapters on every target (one spawned rank builds it; Megatron never enters the pytest process), a source built
once yields exactly what the merged export (`export_hf_weights(MergedParameters(gpt), spec)`) gives, at each push
from the adapters of that push, with no merged copy made before iteration and never more than one bucket's alive."""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gspo_ray.bench.scale import MODELS, Shape, megatron_params, model_spec
from gspo_ray.trainer.weights.bridge import param_map, shard_tp, split_to_hf
from gspo_ray.trainer.weights.weight_buckets import GATHER_EP, GATHER_TP, plan_buckets

sys.path.append(str(Path(__file__).resolve().parents[1] / "trainer"))  # `_spawn`
from _spawn import run_ranks  # noqa: E402

TINY = Shape("tiny-moe", vocab=31, hidden=16, layers=2, heads=4, kv_heads=2, head_dim=8, experts=4, top_k=2,
             moe_ffn=8)


def _local_params(shape: Shape, tp: int, ep: int, tp_rank: int = 0, ep_rank: int = 0, full=None):
    """(Megatron name, this rank's tensor) of every parameter, as a TP x EP Megatron model holds them (meta when
    `full` is None)."""
    spec = model_spec(shape, tp, ep)
    nle = spec.num_local_experts
    out = []
    for name, fshape in megatron_params(shape):
        pm = param_map(name, spec.arch)
        if pm.local_expert is not None:
            if pm.local_expert >= nle:
                continue  # megatron_params names experts globally; a rank holds local experts 0 .. nle - 1
            src = name.replace(f"local_experts.{pm.local_expert}.",
                               f"local_experts.{ep_rank * nle + pm.local_expert}.")
            out.append((name, full[src] if full else torch.empty(fshape, dtype=torch.bfloat16, device="meta")))
            continue
        t = full[name] if full else torch.empty(fshape, dtype=torch.bfloat16, device="meta")
        out.append((name, shard_tp(t, pm, spec, tp, tp_rank)))
    return spec, out


def test_plan_puts_every_tensor_in_once_within_the_bucket_bound():
    a3b = MODELS[2]
    for tp, ep in ((1, 1), (1, 8), (4, 8)):
        spec, params = _local_params(a3b, tp, ep)
        limit = 64 * 2**20
        plan = plan_buckets(((n, tuple(t.shape), t.dtype) for n, t in params), spec, limit)
        planned = [p.name for b in plan for p in b.params]
        assert planned == [n for n, _ in params]  # every parameter once, in the model's order
        for b in plan:
            assert b.full_bytes <= limit or len(b.params) == 1
            assert {p.gather for p in b.params} <= {GATHER_TP, GATHER_EP, "none"}
        hf = [name for b in plan for p in b.params for name, _ in p.hf]
        assert len(hf) == len(set(hf))  # each HF tensor of the full model once
        full_params = sum(torch.Size(s).numel() for _, s in megatron_params(a3b))
        assert sum(b.full_bytes for b in plan) == 2 * full_params  # bf16: the whole model, vocabulary unpadded
        # local bytes packed into the gathers: TP-sharded dense weights over TP, experts over EP
        tp_local = sum(b.local_bytes(GATHER_TP) for b in plan)
        ep_local = sum(b.local_bytes(GATHER_EP) for b in plan)
        assert (tp_local > 0) == (tp > 1) and (ep_local > 0) == (ep > 1)
        if ep > 1:
            experts = a3b.layers * a3b.experts * 3 * a3b.hidden * a3b.moe_ffn
            assert ep_local == 2 * experts // ep


class _ThreadGroup:
    """An all-gather between threads (one per rank of a group): what torch.distributed's does across processes."""

    def __init__(self, size: int, has_rank0: bool) -> None:
        self.slots: list = [None] * size
        self.has_rank0 = has_rank0
        self.barrier = threading.Barrier(size, timeout=60)

    def exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = t.clone()
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return out


def _thread_collect(t, group, to_root):
    """weight_buckets.torch_collect between threads: to_root gathers to global rank 0, other groups skip."""
    shared, rank = group
    if to_root and not shared.has_rank0:
        return None
    out = shared.exchange(rank, t)
    return out if not to_root or rank == 0 else None


@pytest.mark.parametrize("to_root", [False, True])
def test_every_rank_yields_the_unsharded_model_in_metadata_order(to_root):
    """All-gathered (ipc): every rank yields the whole model. Gathered to rank 0 (nccl): rank 0 does, the others
    yield None for every tensor they did not gather and the replicated ones as they are."""
    from gspo_ray.trainer.weights.weight_send import MegatronWeightSource

    # 4 ranks as Megatron lays them out with expert-TP 1: TP groups {0, 1}, {2, 3}; EP groups {0, 1}, {2, 3}
    tp, ep, dp = 2, 2, 2
    spec = model_spec(TINY, tp, ep)
    gen = torch.Generator().manual_seed(0)
    full = {}
    for name, fshape in megatron_params(TINY):
        full[name] = torch.randn(fshape, generator=gen).to(torch.bfloat16)
    expected = []  # the unsharded model's HF tensors (experts: for local index j, EP ranks in order)
    nle = spec.num_local_experts
    for name, _ in megatron_params(TINY):
        pm = param_map(name, spec.arch)
        if pm.local_expert is None:
            expected += list(zip(pm.hf_names, split_to_hf(full[name], pm.merge, spec)))
        elif pm.local_expert < nle:
            for r in range(ep):
                e = r * nle + pm.local_expert
                src = name.replace(f"local_experts.{pm.local_expert}.", f"local_experts.{e}.")
                expected += list(zip(pm.for_expert(e), split_to_hf(full[src], pm.merge, spec)))
    tp_groups = [_ThreadGroup(tp, has_rank0=i == 0) for i in range(dp)]
    ep_groups = [_ThreadGroup(ep, has_rank0=i == 0) for i in range(dp)]
    results, errors = {}, []

    def rank_main(rank: int) -> None:
        tp_rank, ep_rank = rank % tp, rank % ep
        try:
            _, params = _local_params(TINY, tp, ep, tp_rank, ep_rank, full)
            source = MegatronWeightSource(dict(params), spec, bucket_bytes=4096,
                                          tp_group=(tp_groups[rank // tp], tp_rank),
                                          ep_group=(ep_groups[rank // ep], ep_rank), to_root=to_root,
                                          collect=_thread_collect)
            meta = source.metadata()
            pairs = [(n, t) for names, tensors in source.iter_groups() for n, t in zip(names, tensors)]
            assert [(m.name, m.dtype, m.shape) for m in meta] == [(n, t.dtype, tuple(t.shape)) for n, t in pairs
                                                                  if t is not None] or to_root and rank
            results[rank] = (meta, pairs, len(source.plan))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)
            for g in tp_groups + ep_groups:
                g.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(tp * dp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    for rank, (meta, pairs, buckets) in results.items():
        assert buckets > 3  # several buckets, so the per-bucket packing is what is checked
        assert [n for n, _ in pairs] == [n for n, _ in expected], rank
        for (name, got), (_, want) in zip(pairs, expected):
            if to_root and rank and got is None:
                continue
            assert torch.equal(got, want), (rank, name)
            assert got.is_contiguous()
    if to_root:  # ranks 1-3 hold only the replicated tensors (norms, routers): TP and EP shards went to rank 0
        for rank in (1, 2, 3):
            held = [n for n, t in results[rank][1] if t is not None]
            assert held and all("norm" in n or n.endswith("mlp.gate.weight") for n in held), (rank, held)


def _merged_source_scenario(rank, world_size, ports, model_dir):
    """One rank: a source over the merged view of a bf16 MoE with LoRA, iterated twice around an in-place edit of
    every B, each pass against the merged export; merged_weight tracked to count the merged copies alive."""
    import weakref

    from gspo_ray.config.lora import LoRAConfig
    from gspo_ray.trainer.weights.bridge import export_hf_weights
    from gspo_ray.trainer.lora import peft_io
    from gspo_ray.trainer.lora.adapters import adapted_linears, apply_lora
    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed
    from gspo_ray.trainer.weights.weight_send import MegatronWeightSource, push_model

    init_distributed(0, 1, "127.0.0.1", ports[0])
    gpt, spec = build_model(model_dir, dtype=torch.bfloat16)
    apply_lora(gpt, spec, LoRAConfig(rank=4, alpha=8.0, serve="merged"))
    gen = torch.Generator().manual_seed(0)
    pairs = [pair for _, linear in adapted_linears(gpt) for pair in linear.lora.pairs.values()]
    for pair in pairs:  # B = 0 at init: the merge would be the base
        pair.B.data.copy_(0.05 * torch.randn(pair.B.shape, generator=gen))

    made: list = []  # every merged tensor made, and how many were alive (the new one included) at each
    alive_at: list[int] = []
    merge = peft_io.merged_weight

    def tracked(w, delta):
        out = merge(w, delta)
        made.append(weakref.ref(out))
        alive_at.append(sum(ref() is not None for ref in made))
        return out

    peft_io.merged_weight = tracked
    view = push_model(SimpleNamespace(lora=SimpleNamespace(merged_push=True), gpt=gpt))
    source = MegatronWeightSource(view, spec, bucket_bytes=16 * 2**10)
    meta = [(m.name, m.dtype, m.shape) for m in source.metadata()]
    out = {"view": type(view).__name__, "merged_at_build": len(made), "adapted": len(view.adapted),
           "params": len(dict(gpt.named_parameters())), "keys": len(view),
           "live": all(view[n] is p for n, p in gpt.named_parameters() if n not in view.adapted),
           "per_bucket": [sum(p.name in view.adapted for p in b.params) for b in source.plan]}

    def push() -> list:
        made.clear(), alive_at.clear()
        pairs = [(n, t) for names, tensors in source.iter_groups() for n, t in zip(names, tensors)]
        return pairs, max(alive_at)

    def exported() -> list:
        return [(n, t) for b in export_hf_weights(peft_io.MergedParameters(gpt), spec) for n, t in b]

    try:
        out["first"], out["first_alive"] = push()
        out["want_first"] = exported()
        for pair in pairs:  # an optimizer step's in-place update of B
            pair.B.data.mul_(-3.0).add_(0.01)
        out["second"], out["second_alive"] = push()
        out["want_second"] = exported()
    finally:
        peft_io.merged_weight = merge
    out["meta"] = meta
    destroy_distributed()
    return out


def test_merged_lora_source_is_the_merged_export_at_every_push(tmp_path):
    from gspo_ray.models.tiny import ensure_tiny_model

    model_dir = ensure_tiny_model("qwen3_moe", tmp_path / "qwen3_moe", seed=0)
    out = run_ranks(_merged_source_scenario, 1, (str(model_dir),))[0]
    assert out["view"] == "MergedView" and out["keys"] == out["params"] and out["live"]
    assert out["merged_at_build"] == 0  # planned from names, shapes and dtypes: nothing merged at construction
    for got, want in (("first", "want_first"), ("second", "want_second")):
        assert [n for n, _ in out[got]] == [n for n, _ in out[want]] == [m[0] for m in out["meta"]]
        for (name, t), (_, w), (_, dtype, shape) in zip(out[got], out[want], out["meta"], strict=True):
            assert t.dtype == w.dtype == dtype == torch.bfloat16 and tuple(t.shape) == shape, name
            assert torch.equal(t, w), (got, name)
    # the same source, not rebuilt, follows the adapters: every adapted weight moved, nothing else did
    moved = {n for (n, a), (_, b) in zip(out["first"], out["second"]) if not torch.equal(a, b)}
    assert any(".experts." in n for n in moved) and any("q_proj" in n for n in moved)
    assert not any("norm" in n or "embed" in n or n.endswith("mlp.gate.weight") for n in moved), moved
    # one bucket's merged tensors at most, out of many adapted weights in many buckets
    bound = max(out["per_bucket"])
    assert out["adapted"] > bound and sum(c > 0 for c in out["per_bucket"]) > 2, out["per_bucket"]
    assert 1 <= out["first_alive"] <= bound and 1 <= out["second_alive"] <= bound, (out["first_alive"], bound)


def test_adapter_pushes_are_refused_by_the_transfer_sender():
    from gspo_ray.trainer.weights.weight_send import push_model

    full = SimpleNamespace(lora=None, gpt=object())
    assert push_model(full) is full.gpt  # full fine-tuning: the model itself, as before
    with pytest.raises(ValueError, match="trainer.lora.serve adapter pushes the adapter through vLLM's LoRA API"):
        push_model(SimpleNamespace(lora=SimpleNamespace(merged_push=False), gpt=object()))
