"""LoRA adapters in and out: TP/EP shards <-> full tensors under PEFT names, merged weights. The PEFT format itself
(names, adapter_config.json, directories) is models/peft_format.py, which the engines' pushes write too.

    state = export_adapter(gpt, spec)                 # collective; {PEFT name: full fp32 tensor} on every rank
    write_peft_dir(state, out_dir, cfg, base_model)   # adapter_config.json + adapter_model.safetensors
    cfg_json, tensors = read_peft_dir(adapter_dir)    # ValueError naming the path when it is not one
    load_full_adapter(gpt, spec, tensors, where)      # full tensors -> this rank's shards (shapes checked)
    export_hf_weights(MergedParameters(gpt), spec)     # W + scale * B A, one linear at a time (merged pushes)
    view = MergedView(gpt); view[name]                 # the same, merged when read (nccl / ipc merged pushes)

PEFT names (what `peft.PeftModel.from_pretrained` and vLLM's LoRA loader read):
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in], `...lora_B.weight` [out, r]; MoE
experts `base_model.model.model.layers.{i}.mlp.experts.{e}.gate_proj.lora_A.weight` (global expert index e), shared
experts `...mlp.shared_experts.gate_proj...`, multi-latent attention `...self_attn.kv_b_proj...` (q_a_proj, q_b_proj,
kv_a_proj_with_mqa, kv_b_proj, o_proj).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator

import torch
from torch import Tensor, nn

from gspo_ray.models.peft_format import (  # noqa: F401 - the PEFT format, re-exported for the trainer's callers
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    UNSUPPORTED_PEFT,
    peft_config,
    peft_kind_problem,
    peft_names,
    peft_rank_alpha,
    read_peft_dir,
    write_peft_dir,
)
from gspo_ray.trainer.lora.adapters import (
    LoRAPair,
    ParallelLoRA,
    adapted_linears,
    adapter_hf_module,
    shard_pair,
)
from gspo_ray.trainer.model_spec import ModelSpec
from gspo_ray.trainer.weights.bridge import named_weights


def _gather(t: Tensor, group, dim: int) -> Tensor:
    parts = [torch.empty_like(t) for _ in range(group.size())]
    torch.distributed.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def gather_pair(pair: LoRAPair, lora: ParallelLoRA, copy: bool = True) -> tuple[Tensor, Tensor]:
    """Full (A, B) of one target (collective over TP for the split factor; every TP rank gets them). copy=False:
    a factor that needs no gather is the parameter's own (detached) tensor, for a caller that copies at once."""
    a, b = pair.A.detach(), pair.B.detach()
    own = (lambda t: t.clone()) if copy else (lambda t: t)  # noqa: E731
    if lora.local:
        return own(a), own(b)
    if lora.target.kind == "col":
        return own(a), _gather(b, lora.tp_group, 0)
    return _gather(a, lora.tp_group, 1), own(b)


def export_adapter(model: nn.Module, spec: ModelSpec, copy: bool = True) -> dict[str, Tensor]:
    """{PEFT name: full fp32 tensor} of every adapter (collective: every rank of the world calls it; each gets
    the whole adapter, gathered over TP and, for experts, over EP). copy=False: tensors that need no gather are
    the parameters' own, valid until the next optimizer step (a weight push, which copies them at once)."""
    from megatron.core import parallel_state as ps

    out: dict[str, Tensor] = {}
    for _, linear in adapted_linears(model):
        lora: ParallelLoRA = linear.lora
        t = lora.target
        for target, pair in lora.pairs.items():
            a, b = gather_pair(pair, lora, copy)
            if t.local_expert is not None and spec.ep > 1:
                group = ps.get_expert_model_parallel_group()
                a_all, b_all = _gather(a[None], group, 0), _gather(b[None], group, 0)
                for r in range(spec.ep):
                    out |= dict(zip(peft_names(adapter_hf_module(t, target, spec, r)), (a_all[r], b_all[r])))
            else:
                out |= dict(zip(peft_names(adapter_hf_module(t, target, spec)), (a, b)))
    return out


def load_full_adapter(model: nn.Module, spec: ModelSpec, tensors: dict[str, Tensor], where: str) -> None:
    """Full PEFT-named tensors -> this rank's adapter shards. Every adapter of the model must be there and every
    tensor used; ValueError naming `where` and the first mismatch."""
    used = set()
    for _, linear in adapted_linears(model):
        lora: ParallelLoRA = linear.lora
        for target, pair in lora.pairs.items():
            a_name, b_name = peft_names(adapter_hf_module(lora.target, target, spec))
            missing = [n for n in (a_name, b_name) if n not in tensors]
            if missing:
                raise ValueError(f"{where}: no tensor {missing[0]!r} (the adapter targets other modules, or "
                                 "another model)")
            shard_pair(pair, lora, tensors[a_name], tensors[b_name], where=f"{where}: {a_name[:-len('.weight')]}")
            used.update((a_name, b_name))
    if spec.ep > 1:  # the other EP ranks' experts are used there
        used |= {n for n in tensors if ".experts." in n}
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"{where}: {len(extra)} adapter tensors have no place in this run's trainer.lora, e.g. "
                         f"{extra[0]!r} (widen target_modules or use another adapter)")


def merged_weight(w: Tensor, delta: Tensor) -> Tensor:
    """W + delta in W's dtype, summed in fp32 and rounded once: the nearest W-dtype value to the fp32 sum.

    With a bf16 W this loses every update under half a bf16 step of W (|delta| < ulp(W) / 2: 6.1e-5 at |W| ~ 0.02),
    which is why merged bf16 pushes need algorithm.mismatch_correction (docs/lora.md, "Merged pushes in bf16")."""
    return (w.float() + delta).to(w.dtype)


class MergedView(Mapping[str, Tensor]):
    """`model`'s parameters by name, each adapted linear's weight read as W + scale * B A (this rank's shard, in W's
    dtype: `merged_weight`) when it is looked up; every other parameter is the live parameter itself.

    Nothing is merged until a value is read, and the view keeps no merged tensor: keys and `param_meta()` (name,
    shape, dtype, all the base parameter's) come from the parameters alone, and each `view[name]` merges again from
    the adapters as they are then. So a view built once serves every push (the nccl / ipc source reads it bucket by
    bucket at each push, trainer/weights/weight_send.py) and never goes stale after an optimizer step, and only what the
    reader still holds is alive (R4: never every adapted weight's merged copy at once). Adapters are matched to
    weights by the weight tensor itself, not its name: a grouped-GEMM expert's adapter sits on a view whose weight
    is the grouped linear's weight{j}."""

    def __init__(self, model: nn.Module):
        by_weight = {id(linear.weight): linear for _, linear in adapted_linears(model)}
        self._params: dict[str, Tensor] = dict(named_weights(model))  # carried buffers too (the expert bias)
        self._linears = {n: by_weight[id(p)] for n, p in self._params.items() if id(p) in by_weight}

    @property
    def adapted(self) -> list[str]:
        """Names of the weights read merged, in parameter order."""
        return list(self._linears)

    def param_meta(self) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, shape, dtype) of every value, without merging (a merged weight keeps its base's shape and dtype)."""
        return ((n, tuple(p.shape), p.dtype) for n, p in self._params.items())

    def __getitem__(self, name: str) -> Tensor:
        param, linear = self._params[name], self._linears.get(name)
        if linear is None:
            return param
        with torch.no_grad():
            return merged_weight(param.detach(), linear.lora.delta_weight())

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


class MergedParameters:
    """`model` as the weight exporter reads it (`export_hf_weights(MergedParameters(gpt), spec)`: the exporter
    only calls `named_parameters()`), with each adapted linear's weight read as W + scale * B A (this rank's shard).

    One merged weight at a time: an adapted linear's merged tensor is built (`MergedView`) when the exporter reaches
    it and dropped when it moves on (the exporter keeps its own bucket copy), so a push holds one linear's merged
    copy, not one per adapted weight (an MoE adapts nearly every expert weight). The parameters themselves are
    never touched."""

    def __init__(self, model: nn.Module):
        self.model = model

    def named_parameters(self):
        view = MergedView(self.model)
        for name in view:
            yield name, view[name]  # no local keeps it: gone once the exporter drops it, before the next merge


def expected_adapter_shapes(spec: ModelSpec, rank: int, targets: list[str]) -> dict[str, tuple[int, int]]:
    """{PEFT name: full shape} of every adapter trainer.lora puts on this model (torch only, no process group):
    what an `init_from` adapter must hold, exactly."""
    from gspo_ray.trainer.lora.adapters import full_in_size, full_out_sizes, match_linear

    mla = spec.extra.get("mla")
    attention = ["linear_qkv"] if not mla else (["linear_q_proj"] if mla["q_lora_rank"] is None else [
        "linear_q_down_proj", "linear_q_up_proj"]) + ["linear_kv_down_proj", "linear_kv_up_proj"]
    linears = []
    for i in range(spec.num_layers):
        linears += [f"decoder.layers.{i}.self_attention.{n}" for n in attention + ["linear_proj"]]
        shared = [f"decoder.layers.{i}.mlp.shared_experts"] if spec.shared_expert_ffn_hidden_size else []
        mlps = ([f"decoder.layers.{i}.mlp.experts.local_experts.{e}" for e in range(spec.num_experts)] + shared
                if i in spec.moe_layers else [f"decoder.layers.{i}.mlp"])
        linears += [f"{m}.{fc}" for m in mlps for fc in ("linear_fc1", "linear_fc2")]
    out = {}
    for name in linears:
        t = match_linear(name, targets)
        if t is None:
            continue
        fan_in, outs = full_in_size(t, spec), full_out_sizes(t, spec)
        for target in t.targets:
            a, b = peft_names(adapter_hf_module(t, target, spec, ep_rank=0))
            out[a], out[b] = (rank, fan_in), (outs[target], rank)
    return out
