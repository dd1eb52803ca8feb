"""Megatron trainer checkpoint -> HF model directory, offline: no process group, from any DP/TP/EP layout.

    state = dict(hf_tensors("runs/job/checkpoints/step_000050/trainer", "runs/job/model"))   # small models
    export_checkpoint(ckpt_dir, model_dir, out_dir, dtype="bfloat16")   # safetensors + config + tokenizer files

A trainer checkpoint holds each model tensor once, in the file of the first rank with its TP rank (dense) or EP
rank (experts; expert-TP is 1) (`trainer/checkpoints/shards.py`), so one saved rank per TP rank and one per EP rank hold
the whole model, whatever the data-parallel size was. The export streams: one parameter at a time, model tensors only
(rank files memory-mapped, the optimizer slices beside them never read), safetensors shards written as they fill.
TP shards are joined with the converter's own rules (`bridge.unshard_tp`, `bridge.split_to_hf`): the tensors are
the ones the live export (`export_hf_weights`, the weight sync) produces from the same weights. `model_dir` is the HF
directory the run trained from: it gives the architecture (config.json) and the tokenizer, chat template and generation
config that are copied next to the weights.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from gspo_ray.trainer.checkpoints import checkpoint as ckpt
from gspo_ray.trainer.weights.bridge import (
    param_map,
    skipped_hf_tensors,
    split_to_hf,
    unshard_tp,
    write_hf_side_files,
)
from gspo_ray.trainer.families import family_of
from gspo_ray.trainer.model_spec import DTYPES, ModelSpec, read_hf_config, spec_from_hf_config


def checkpoint_spec(ckpt_dir: str | Path, model_dir: str | Path) -> ModelSpec:
    """The architecture of the model in `model_dir`, in the TP/EP layout the checkpoint was written with."""
    meta = ckpt.read_meta(ckpt_dir)
    return spec_from_hf_config(read_hf_config(model_dir), str(model_dir), tp=meta["tp"], ep=meta["ep"])


class _ModelReader:
    """Model tensors of a checkpoint's rank files, memory-mapped: the optimizer slices beside them are never read,
    and `release` unmaps what was read so far (the pages it touched leave this process's memory)."""

    def __init__(self, ckpt_dir: Path):
        self.dir, self._open = ckpt_dir, {}

    def model(self, rank: int) -> dict:
        if rank not in self._open:
            self._open[rank] = ckpt.load_rank_payload(self.dir, rank, mmap=True)["model"]
        return self._open[rank]

    def release(self) -> None:
        self._open.clear()


def hf_tensors(ckpt_dir: str | Path, model_dir: str | Path,
               release_bytes: int = 2 ** 28) -> Iterator[tuple[str, Tensor]]:
    """The HF tensors of a trainer checkpoint, one Megatron parameter at a time (per-expert names; no lm_head when
    embeddings are tied), each an owned contiguous copy. Reads model tensors only, from memory-mapped rank files,
    unmapped again after every `release_bytes` read."""
    ckpt_dir = Path(ckpt_dir)
    meta = ckpt.read_meta(ckpt_dir)
    spec = checkpoint_spec(ckpt_dir, model_dir)
    reader = _ModelReader(ckpt_dir)
    read = 0
    for stage in range(int(meta.get("pp", 1))):  # pipeline stages in order, each its own (global) names
        tp_src = [ckpt.find_rank(meta, tp_rank=r, pp_rank=stage) for r in range(spec.tp)]
        ep_src = [ckpt.find_rank(meta, ep_rank=r, pp_rank=stage) for r in range(spec.ep)] if spec.is_moe else []
        names = [n for n, v in reader.model(tp_src[0]).items() if isinstance(v, Tensor)]
        seen = set(names)
        names += [n for n, v in (reader.model(ep_src[0]) if ep_src else {}).items()
                  if isinstance(v, Tensor) and ckpt.EXPERT_KEY in n and n not in seen]
        family = family_of(spec.arch)  # its checkpoint layout (gpt-oss fuses its experts)
        for n, t in family.hf_tensors_out(_stage_tensors(reader, spec, names, tp_src, ep_src), spec):
            read += t.numel() * t.element_size()
            yield n, t
            if read > release_bytes:  # unmap what was read so far: its pages leave this process's resident memory
                reader.release()
                read = 0


def _stage_tensors(reader, spec: ModelSpec, names: list[str], tp_src: list[int], ep_src: list[int]):
    """(HF name, owned contiguous copy) of the Megatron tensors `names` of one pipeline stage, read from the saved
    ranks of its TP (dense) / EP (experts) coordinates."""
    for name in names:
        if name.endswith("._extra_state"):
            continue  # Megatron's per-module extra state (None for the local layer spec)
        if spec.tied_embeddings and name == "output_layer.weight":
            continue  # HF ties lm_head to the embedding: it has no tensor of its own
        pm = param_map(name, spec.arch)
        if pm.local_expert is not None:  # local expert j of EP rank r is global expert r * num_local + j
            for r, src in enumerate(ep_src):
                hf = pm.for_expert(r * spec.num_local_experts + pm.local_expert)
                for n, t in zip(hf, split_to_hf(reader.model(src)[name], pm.merge, spec)):
                    # owned, contiguous copies: safetensors refuses views that share storage (fused q/k/v split)
                    yield n, t.clone(memory_format=torch.contiguous_format)
            continue
        full = unshard_tp([reader.model(src)[name] for src in tp_src], pm, spec)
        for n, t in zip(pm.hf_names, split_to_hf(full, pm.merge, spec)):
            yield n, t.clone(memory_format=torch.contiguous_format)


def write_safetensors_shards(tensors: Iterable[tuple[str, Tensor]], out: Path, max_shard_bytes: int) -> int:
    """Write (name, tensor) pairs as safetensors shards of <= max_shard_bytes each (a larger tensor gets its own),
    named as HF names them (`model.safetensors`, or `model-0000i-of-0000n.safetensors` with an index), while they
    come: at most one shard's tensors are held. Returns the number of shards."""
    from safetensors.torch import save_file

    files, weight_map, total, bucket, size = [], {}, 0, {}, 0

    def flush():
        nonlocal bucket, size
        if bucket:
            tmp = out / f".shard-{len(files)}.safetensors"
            save_file(bucket, str(tmp), metadata={"format": "pt"})
            files.append((tmp, list(bucket)))
            bucket, size = {}, 0

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > max_shard_bytes:
            flush()
        bucket[name], size = t, size + nbytes
        total += nbytes
    flush()
    n = len(files)
    for i, (tmp, names) in enumerate(files):
        final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(tmp, out / final)
        weight_map.update({k: final for k in names})
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return n


def export_checkpoint(ckpt_dir: str | Path, model_dir: str | Path, out_dir: str | Path,
                      dtype: str | None = None, max_shard_bytes: int = 2 ** 31) -> Path:
    """Write the HF directory of a trainer checkpoint to `out_dir` (replaced if it exists; written to a temp
    directory first, so a crash never leaves a half-written model that looks complete). `dtype`: float32 |
    bfloat16 | float16 (default: the training dtype). A LoRA checkpoint gives the merged model.

    Streamed: model tensors are read one parameter at a time from memory-mapped rank files (never the optimizer
    state) and written in safetensors shards of `max_shard_bytes` as they come, so this process holds about one
    shard, not the model (the LoRA merge still builds the merged state in memory, trainer/lora/export.py).

    The tensors the trainer's model skips (the multi-token-prediction layers of GLM-4.5 / DeepSeek-V3 checkpoints,
    `Family.ignored_hf_tensor`) are copied from `model_dir` unchanged (cast only when `dtype` is given), so the
    export is as complete as the checkpoint trained from; the LoRA merge starts from every base tensor already."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"export dtype {dtype!r} unknown; valid: {', '.join(DTYPES)}")
    from gspo_ray.trainer.lora.export import checkpoint_lora, merged_hf_state

    # a LoRA checkpoint holds adapters only: the HF model is the base with them merged (trainer/lora/export.py)
    lora = checkpoint_lora(ckpt_dir) is not None
    tensors = iter(merged_hf_state(ckpt_dir, model_dir).items()) if lora else itertools.chain(
        hf_tensors(ckpt_dir, model_dir), skipped_hf_tensors(model_dir, read_hf_config(model_dir)))
    if dtype is not None:
        tensors = ((k, v.to(DTYPES[dtype])) for k, v in tensors)
    first = next(tensors)
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write_hf_side_files(read_hf_config(model_dir), model_dir, tmp, first[1].dtype)
    write_safetensors_shards(itertools.chain([first], tensors), tmp, max_shard_bytes)
    for f in tmp.iterdir():  # safetensors writes 0600; the model is meant to be served and shared like its source
        f.chmod(0o644)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
