"""Megatron trainer checkpoint -> HF model directory, offline: no process group, from any DP/TP/EP layout.

    state = hf_state_from_checkpoint("runs/job/checkpoints/step_000050/trainer", "runs/job/model")
    export_checkpoint(ckpt_dir, model_dir, out_dir, dtype="bfloat16")   # safetensors + config + tokenizer files

A trainer checkpoint holds one Megatron state-dict shard per rank (`trainer/checkpoint.py`). Dense parameters
depend only on the TP rank and expert parameters only on the EP rank (expert-TP is 1), so one saved rank per TP
rank and one per EP rank hold the whole model, whatever the data-parallel size was. Their shards are joined with
the converter's own rules (`bridge.unshard_tp`, `bridge.split_to_hf`): the tensors are the ones the live export
(`export_hf_weights`, the weight sync) produces from the same weights. `model_dir` is the HF directory the run
trained from: it gives the architecture (config.json) and the tokenizer, chat template and generation config
that are copied next to the weights.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import Tensor

from gspo_ray.trainer import checkpoint as ckpt
from gspo_ray.trainer.bridge import param_map, split_to_hf, unshard_tp, write_hf_dir
from gspo_ray.trainer.model_spec import DTYPES, ModelSpec, read_hf_config, spec_from_hf_config


def checkpoint_spec(ckpt_dir: str | Path, model_dir: str | Path) -> ModelSpec:
    """The architecture of the model in `model_dir`, in the TP/EP layout the checkpoint was written with."""
    meta = ckpt.read_meta(ckpt_dir)
    return spec_from_hf_config(read_hf_config(model_dir), str(model_dir), tp=meta["tp"], ep=meta["ep"])


def _shards(ckpt_dir: Path, meta: dict, key: str, size: int) -> list[dict]:
    """Model state dicts of one saved rank per `key` coordinate (tp_rank or ep_rank) 0..size-1."""
    return [ckpt.load_rank_payload(ckpt_dir, ckpt.find_rank(meta, **{key: r, "pp_rank": 0}))["model"]
            for r in range(size)]


def hf_state_from_checkpoint(ckpt_dir: str | Path, model_dir: str | Path) -> dict[str, Tensor]:
    """The full HF state dict of a trainer checkpoint (per-expert names; no lm_head when embeddings are tied)."""
    ckpt_dir = Path(ckpt_dir)
    meta = ckpt.read_meta(ckpt_dir)
    spec = checkpoint_spec(ckpt_dir, model_dir)
    dense = _shards(ckpt_dir, meta, "tp_rank", spec.tp)
    experts = _shards(ckpt_dir, meta, "ep_rank", spec.ep) if spec.is_moe else []
    out: dict[str, Tensor] = {}
    for name, value in dense[0].items():
        if not isinstance(value, Tensor) or name.endswith("._extra_state"):
            continue  # Megatron's per-module extra state (None for the local layer spec)
        if spec.tied_embeddings and name == "output_layer.weight":
            continue  # HF ties lm_head to the embedding: it has no tensor of its own
        pm = param_map(name, spec.arch)
        if pm.local_expert is not None:  # local expert j of EP rank r is global expert r * num_local + j
            for r, shard in enumerate(experts):
                names = pm.for_expert(r * spec.num_local_experts + pm.local_expert)
                out.update(zip(names, split_to_hf(shard[name], pm.merge, spec)))
            continue
        full = unshard_tp([shard[name] for shard in dense], pm, spec)
        out.update(zip(pm.hf_names, split_to_hf(full, pm.merge, spec)))
    # owned, contiguous copies: safetensors refuses views that share storage (fused q/k/v split, gate/up halves)
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in out.items()}


def export_checkpoint(ckpt_dir: str | Path, model_dir: str | Path, out_dir: str | Path,
                      dtype: str | None = None) -> Path:
    """Write the HF directory of a trainer checkpoint to `out_dir` (replaced if it exists; written to a temp
    directory first, so a crash never leaves a half-written model that looks complete). `dtype`: float32 |
    bfloat16 | float16 (default: the training dtype). A LoRA checkpoint gives the merged model."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"export dtype {dtype!r} unknown; valid: {', '.join(DTYPES)}")
    from gspo_ray.trainer.lora.export import checkpoint_lora, merged_hf_state

    # a LoRA checkpoint holds adapters only: the HF model is the base with them merged (trainer/lora/export.py)
    lora = checkpoint_lora(ckpt_dir) is not None
    state = merged_hf_state(ckpt_dir, model_dir) if lora else hf_state_from_checkpoint(ckpt_dir, model_dir)
    if dtype is not None:
        state = {k: v.to(DTYPES[dtype]) for k, v in state.items()}
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write_hf_dir(state, read_hf_config(model_dir), model_dir, tmp)
    for f in tmp.iterdir():  # safetensors writes 0600; the model is meant to be served and shared like its source
        f.chmod(0o644)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
