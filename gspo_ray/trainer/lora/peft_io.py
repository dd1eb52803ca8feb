"""LoRA adapters in and out: HF/PEFT names, TP/EP shards <-> full tensors, PEFT directories, merged weights.

    state = export_adapter(gpt, spec)                 # collective; {PEFT name: full fp32 tensor} on every rank
    write_peft_dir(state, out_dir, cfg, base_model)   # adapter_config.json + adapter_model.safetensors
    cfg_json, tensors = read_peft_dir(adapter_dir)    # ValueError naming the path when it is not one
    load_full_adapter(gpt, spec, tensors, where)      # full tensors -> this rank's shards (shapes checked)
    export_hf_weights(MergedParameters(gpt), spec)     # W + scale * B A, one linear at a time (merged pushes)
    view = MergedView(gpt); view[name]                 # the same, merged when read (nccl / ipc merged pushes)

PEFT names (what `peft.PeftModel.from_pretrained` and vLLM's LoRA loader read):
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in], `...lora_B.weight` [out, r]; MoE
experts `base_model.model.model.layers.{i}.mlp.experts.{e}.gate_proj.lora_A.weight` (global expert index e).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor, nn

from gspo_ray.trainer.lora.adapters import (
    LoRAPair,
    ParallelLoRA,
    adapted_linears,
    adapter_hf_module,
    shard_pair,
)
from gspo_ray.trainer.model_spec import ModelSpec

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def peft_names(hf_module: str) -> tuple[str, str]:
    return f"{PEFT_PREFIX}{hf_module}.lora_A.weight", f"{PEFT_PREFIX}{hf_module}.lora_B.weight"


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


def peft_config(state: dict[str, Tensor], rank: int, alpha: float, base_model: str = "") -> dict:
    """adapter_config.json of a plain LoRA adapter holding `state` (PEFT names): what peft and vLLM read. The
    trainer's exports and the engines' pushes (rollout/lora_adapter.py, scale folded in: alpha = rank) write it."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
            "target_modules": sorted({n.split(".")[-3] for n in state}), "bias": "none",
            "base_model_name_or_path": base_model, "fan_in_fan_out": False, "inference_mode": True,
            "use_rslora": False, "init_lora_weights": True, "modules_to_save": None}


def write_peft_dir(state: dict[str, Tensor], out_dir: str | Path, *, rank: int, alpha: float,
                   target_modules: list[str], base_model: str = "", dtype: torch.dtype = torch.float32) -> Path:
    """A PEFT LoRA adapter directory: adapter_config.json + adapter_model.safetensors (written to a temporary
    name, then renamed, so a reader never sees half a file)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = peft_config(state, rank, alpha, base_model)
    if set(config["target_modules"]) - set(target_modules):
        raise ValueError(f"adapter tensors target {config['target_modules']}, config says {target_modules}")
    tmp = out / (ADAPTER_WEIGHTS + ".tmp")
    save_file({k: v.detach().to(dtype).contiguous() for k, v in state.items()}, str(tmp))
    tmp.replace(out / ADAPTER_WEIGHTS)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_peft_dir(adapter_dir: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """(adapter_config.json, {name: tensor}) of a PEFT LoRA directory; ValueError naming the path otherwise."""
    from safetensors.torch import load_file

    d = Path(adapter_dir)
    cfg_path, weights = d / ADAPTER_CONFIG, d / ADAPTER_WEIGHTS
    if not d.is_dir():
        raise ValueError(f"{d}: not a directory (trainer.lora.init_from needs a PEFT adapter directory)")
    if not cfg_path.is_file() or not weights.is_file():
        raise ValueError(f"{d}: not a PEFT adapter directory (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    cfg = json.loads(cfg_path.read_text())
    if str(cfg.get("peft_type", "")).upper() != "LORA":
        raise ValueError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r}, only LORA adapters load")
    tensors = load_file(str(weights))
    # PEFT saves without the adapter name ('.lora_A.weight'); some tools keep '.lora_A.default.weight'
    return cfg, {k.replace(".default.weight", ".weight"): v for k, v in tensors.items()}


# adapter_config.json fields of LoRA variants the trainer cannot reproduce: (key, why)
UNSUPPORTED_PEFT = (
    ("use_rslora", "rsLoRA scales the update by alpha / sqrt(r), the trainer by alpha / r"),
    ("use_dora", "DoRA adds a magnitude vector the trainer does not have"),
    ("rank_pattern", "per-module ranks; the trainer uses one trainer.lora.rank"),
    ("alpha_pattern", "per-module alphas; the trainer uses one trainer.lora.alpha"),
)


def peft_kind_problem(cfg: dict) -> str | None:
    """Why an adapter_config.json describes a LoRA the trainer cannot load (None: plain LoRA), naming the field."""
    for key, why in UNSUPPORTED_PEFT:
        if cfg.get(key):
            return f"adapter_config.json sets {key}={json.dumps(cfg[key])}: {why} (plain LoRA only)"
    return None


def peft_rank_alpha(cfg: dict, where: str) -> tuple[int, float]:
    """(r, lora_alpha) of an adapter_config.json; the variants of UNSUPPORTED_PEFT are refused."""
    problem = peft_kind_problem(cfg)
    if problem:
        raise ValueError(f"{where}: {problem}")
    return int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))


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
    bucket at each push, trainer/weight_send.py) and never goes stale after an optimizer step, and only what the
    reader still holds is alive (R4: never every adapted weight's merged copy at once). Adapters are matched to
    weights by the weight tensor itself, not its name: a grouped-GEMM expert's adapter sits on a view whose weight
    is the grouped linear's weight{j}."""

    def __init__(self, model: nn.Module):
        by_weight = {id(linear.weight): linear for _, linear in adapted_linears(model)}
        self._params: dict[str, Tensor] = dict(model.named_parameters())
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

    linears = []
    for i in range(spec.num_layers):
        linears += [f"decoder.layers.{i}.self_attention.linear_qkv", f"decoder.layers.{i}.self_attention.linear_proj"]
        mlps = ([f"decoder.layers.{i}.mlp.experts.local_experts.{e}" for e in range(spec.num_experts)]
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
