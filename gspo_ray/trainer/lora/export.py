"""LoRA checkpoints out, offline (no process group): a PEFT adapter directory, or the merged HF model.

    lora, state = adapter_from_checkpoint(ckpt_dir, model_dir)   # meta["lora"], {PEFT name: full tensor}
    export_adapter_dir(ckpt_dir, model_dir, out)                 # adapter_config.json + adapter_model.safetensors
    merged = merged_hf_state(ckpt_dir, model_dir)                # base HF tensors + (alpha / r) B A

A LoRA checkpoint's rank files hold only adapter shards (`<linear>.lora.pairs.<target>.A|B`, adapters.py). They are
joined like the live export does (peft_io.py): column-parallel linears' B over TP rows, row-parallel linears' A over
TP columns, experts by EP rank (global expert = ep_rank * local experts + local index).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor

from gspo_ray.config.lora import LORA_TARGETS
from gspo_ray.trainer.checkpoints import checkpoint as ckpt
from gspo_ray.trainer.weights.bridge import HFCheckpoint, is_lora_param
from gspo_ray.trainer.lora.adapters import adapter_hf_module, match_linear
from gspo_ray.trainer.lora.peft_io import peft_names, write_peft_dir
from gspo_ray.trainer.model_spec import ModelSpec, read_hf_config, spec_from_hf_config

_PARAM = re.compile(r"(?P<module>.+)\.lora\.pairs\.(?P<target>[a-z_]+)\.(?P<factor>[AB])")


def checkpoint_lora(ckpt_dir: str | Path) -> dict | None:
    """meta.json's `lora` ({rank, alpha, target_modules}) of a trainer checkpoint; None for full fine-tuning."""
    return ckpt.read_meta(ckpt_dir).get("lora")


def _spec(meta: dict, model_dir) -> ModelSpec:
    return spec_from_hf_config(read_hf_config(model_dir), str(model_dir), tp=meta["tp"], ep=meta["ep"])


def adapter_from_checkpoint(ckpt_dir: str | Path, model_dir: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """(meta["lora"], {PEFT name: full fp32 tensor}) of a LoRA trainer checkpoint."""
    meta = ckpt.read_meta(ckpt_dir)
    lora = meta.get("lora")
    if lora is None:
        raise ValueError(f"{ckpt_dir}: a full fine-tuning checkpoint, it has no LoRA adapter")
    spec = _spec(meta, model_dir)
    by_tp = [ckpt.load_rank_payload(ckpt_dir, ckpt.find_rank(meta, tp_rank=r, pp_rank=0))["model"]
             for r in range(spec.tp)]
    by_ep = [ckpt.load_rank_payload(ckpt_dir, ckpt.find_rank(meta, ep_rank=r, pp_rank=0))["model"]
             for r in range(spec.ep)] if spec.is_moe else []
    out: dict[str, Tensor] = {}
    for name in sorted(k for k in by_tp[0] if is_lora_param(k)):
        m = _PARAM.fullmatch(name)
        t = match_linear(m["module"], list(LORA_TARGETS)) if m else None
        if t is None:
            raise ValueError(f"{ckpt_dir}: adapter parameter {name!r} of no known linear")
        a_or_b = 0 if m["factor"] == "A" else 1
        if t.local_expert is not None:
            for r, shard in enumerate(by_ep):
                out[peft_names(adapter_hf_module(t, m["target"], spec, ep_rank=r))[a_or_b]] = shard[name].float()
            continue
        # column: B split on rows; row: A split on columns; replicated (MLA's kv_down): neither
        split = t.kind != "rep" and (m["factor"] == "B") == (t.kind == "col")
        parts = [s[name] for s in by_tp] if split and spec.tp > 1 else [by_tp[0][name]]
        full = torch.cat(parts, dim=0 if t.kind == "col" else 1)
        out[peft_names(adapter_hf_module(t, m["target"], spec, ep_rank=0))[a_or_b]] = full.float()
    return lora, out


def export_adapter_dir(ckpt_dir: str | Path, model_dir: str | Path, out_dir: str | Path,
                       dtype: torch.dtype = torch.float32) -> Path:
    """`gspo-ray export` of a LoRA run: a PEFT adapter directory that peft and vLLM load over `model_dir`."""
    lora, state = adapter_from_checkpoint(ckpt_dir, model_dir)
    return write_peft_dir(state, out_dir, rank=lora["rank"], alpha=lora["alpha"],
                          target_modules=lora["target_modules"], base_model=str(Path(model_dir).resolve()),
                          dtype=dtype)


def _base_tensors(model_dir: str | Path) -> dict[str, Tensor]:
    """Every base tensor by HF name, fused experts (transformers 5's layout) served per expert."""
    base = HFCheckpoint(model_dir)
    fused = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")
    out = {}
    for name in sorted(base.keys()):
        m = fused.fullmatch(name)
        if m is None:
            out[name] = base.get(name)
            continue
        projs = ("gate_proj", "up_proj") if m[2] == "gate_up_proj" else ("down_proj",)
        for e in range(base.get(name).shape[0]):
            for p in projs:
                out[f"{m[1]}.{e}.{p}.weight"] = base.get(f"{m[1]}.{e}.{p}.weight")
    return out


def merged_hf_state(ckpt_dir: str | Path, model_dir: str | Path) -> dict[str, Tensor]:
    """The base model's HF tensors with every adapter merged: W + (alpha / r) B A, in W's dtype."""
    lora, adapter = adapter_from_checkpoint(ckpt_dir, model_dir)
    scale = lora["alpha"] / lora["rank"]
    state = _base_tensors(model_dir)
    for a_name in (n for n in adapter if n.endswith(".lora_A.weight")):
        module = a_name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = adapter[a_name.replace(".lora_A.", ".lora_B.")]
        w = state[module + ".weight"]
        state[module + ".weight"] = (w.float() + scale * (b @ adapter[a_name])).to(w.dtype)
    return state
