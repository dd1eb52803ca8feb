"""HF <-> Megatron weight conversion (qwen2, qwen3, qwen3_moe, llama, mixtral), sharded by TP and EP.

    load_hf_weights(model, spec, hf_dir) -> None                       # HF safetensors -> this rank's shards
    export_hf_weights(model, spec, bucket_mb=64) -> Iterator[list[tuple[str, Tensor]]]   # collective
    hf_state_dict_from_megatron(model, spec) -> dict[str, Tensor]     # collective; the whole HF state dict
    save_hf_checkpoint(model, spec, out_dir, tokenizer_src_dir=None) -> None   # collective; rank 0 writes
    skipped_hf_tensors(hf_dir, hf_config) -> Iterator[(name, Tensor)]   # the tensors the model skips (MTP layers)
    write_hf_dir(hf_state, hf_config, src_dir, out_dir) -> Path       # no process group: a full state dict in hand

Export is collective: every rank of the world calls it, in the same order, and every rank yields the same full
(unsharded) tensors with exactly the HF names and shapes of the original checkpoint (per-expert names
`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`; no lm_head when embeddings are tied), in the model's dtype.
They are owned copies, never views of parameters the optimizer will change.

Layouts (what `param_map` encodes per Megatron parameter):
- `linear_qkv` fuses q, k, v per query group: [group 0: q heads of the group, k, v | group 1: ...]; TP splits whole
  groups (contiguous rows). Qwen2's q/k/v biases are fused the same way.
- `linear_fc1` (dense and experts) is [gate; up]; TP splits gate and up separately, each rank holding
  [gate_r; up_r].
- `linear_proj` / `linear_fc2` split columns (row-parallel); embeddings and output layer split vocabulary rows,
  padded with zero rows up to a multiple of TP.
- Experts (expert-TP 1): local expert j on EP rank r is global expert r * num_local_experts + j.
- The rules are the family's (`Family.name_rules`, families/base.py: Megatron name -> HF names with the Qwen
  names, how they merge, how TP shards them; local and Transformer Engine names alike); a family whose checkpoints
  name tensors otherwise renames them (`Family.hf_name`: Mixtral's `block_sparse_moe` with experts `w1` (gate),
  `w3` (up), `w2` (down)), so `param_map(name, "mixtral")` gives Mixtral's names.
"""
from __future__ import annotations

import functools
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from gspo_ray.trainer.attention.gated_attention import merge_gated_qkv, split_gated_qkv
from gspo_ray.trainer.families import family_of
from gspo_ray.trainer.families.base import Family
from gspo_ray.trainer.model_spec import ModelSpec
from gspo_ray.trainer.weights.stage_names import global_layer_name, layer_offset

@dataclass(frozen=True)
class ParamMap:
    """How one Megatron parameter relates to HF tensors. `local_expert` is set for expert params (EP-sharded)."""

    hf_names: tuple[str, ...]
    merge: str                       # "copy" | "qkv" | "qkv_gate" | "gated"
    shard: str                       # "none" | "col" (dim 0) | "row" (dim 1) | "vocab" (dim 0, padded)
    local_expert: int | None = None

    def for_expert(self, global_expert: int) -> tuple[str, ...]:
        return tuple(n.replace("{e}", str(global_expert)) for n in self.hf_names)


def hf_name_of(qwen_style_name: str, arch: str | None) -> str:
    """A rule's Qwen-style HF name -> the name `arch`'s family gives that tensor (unchanged for a model_type no family
    takes, or None)."""
    family = family_of(arch)
    return family.hf_name(qwen_style_name) if family is not None else qwen_style_name


@functools.lru_cache(maxsize=65536)  # pure and called per tensor at every export: a push names ~420 adapters
def param_map(megatron_name: str, arch: str | None = None) -> ParamMap:
    """Megatron parameter name -> ParamMap (expert names keep an `{e}` placeholder for the global index).
    `arch` (the HF model_type) picks that family's rules and HF names (`Family.name_rules`, `Family.hf_name`); a
    model_type no family takes (or None) gets the base family's."""
    family = family_of(arch)
    for pattern, names, merge, shard in (family.name_rules if family is not None else Family.name_rules):
        m = re.fullmatch(pattern, megatron_name)
        if m:
            groups = m.groups()
            layer = groups[0] if groups else None
            expert = int(groups[1]) if len(groups) > 1 else None
            names = tuple(hf_name_of(n.replace("{i}", layer) if layer is not None else n, arch) for n in names)
            return ParamMap(names, merge, shard, expert)
    raise KeyError(f"no HF mapping for Megatron parameter {megatron_name!r}")


# Buffers that are model weights in the HF checkpoint: loaded, pushed, exported and checkpointed with the parameters
# (a DeepSeekMoE router's expert bias, HF `mlp.gate.e_score_correction_bias`); no optimizer updates them.
CARRIED_BUFFERS = (".router.expert_bias",)


def named_weights(model) -> Iterator[tuple[str, Tensor]]:
    """Every tensor the HF checkpoint holds, as this rank has it: the parameters, then the carried buffers (in
    module order), under their global names (a pipeline stage's layers renumbered: stage_names.py). `model` may be
    anything with `named_parameters()` (lora.peft_io.MergedParameters). With tied embeddings the last pipeline
    stage's copy of the embedding (`output_layer.weight`, which Megatron keeps equal to the first stage's) is no
    HF tensor and is left out: `tied_output_copy` loads it."""
    offset = layer_offset(model)
    for name, param in model.named_parameters():
        if not is_tied_output_copy(model, name):
            yield global_layer_name(name, offset), param
    if hasattr(model, "named_buffers"):
        for name, buf in model.named_buffers():
            if name.endswith(CARRIED_BUFFERS):
                yield global_layer_name(name, offset), buf


def is_tied_output_copy(model, name: str) -> bool:
    """`output_layer.weight` of a last pipeline stage whose output layer shares the first stage's embedding (PP > 1
    with tied embeddings): Megatron holds it as a copy, its gradients summed with the embedding's."""
    return name.endswith("output_layer.weight") and bool(getattr(_gpt(model), "share_embeddings_and_output_weights",
                                                                   False)) and not getattr(_gpt(model), "pre_process",
                                                                                           True)


def _gpt(model):
    while not hasattr(model, "share_embeddings_and_output_weights") and hasattr(model, "module"):
        model = model.module
    return model


def is_lora_param(name: str) -> bool:
    """A LoRA adapter parameter (trainer/lora/adapters.py names them `<linear>.lora.pairs.<target>.A|B`), not a
    base tensor."""
    return ".lora." in name


# ---- pure tensor maths: HF tensors <-> full (TP=1) Megatron tensor <-> TP shards ---------------------------------
def merge_hf(tensors: list[Tensor], merge: str, spec: ModelSpec) -> Tensor:
    """HF tensors (in ParamMap order) -> the Megatron tensor as it is at TP=1."""
    if merge == "copy":
        return tensors[0]
    if merge == "gated":
        return torch.cat(tensors, dim=0)
    if merge == "qkv_gate":  # q_proj holds [q | gate] per head (trainer/attention/gated_attention.py)
        return merge_gated_qkv(*tensors, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    q, k, v = tensors  # [heads*d, ...], [groups*d, ...], [groups*d, ...]
    groups, rest = spec.num_kv_heads, q.shape[1:]
    fused = torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)], 1)
    return fused.reshape(-1, *rest)


def split_to_hf(full: Tensor, merge: str, spec: ModelSpec) -> list[Tensor]:
    """Inverse of merge_hf."""
    if merge == "copy":
        return [full]
    if merge == "gated":
        return list(full.chunk(2, dim=0))
    if merge == "qkv_gate":
        return list(split_gated_qkv(full, spec.num_heads, spec.num_kv_heads, spec.head_dim))
    groups, rest, d = spec.num_kv_heads, full.shape[1:], spec.head_dim
    per_group = full.reshape(groups, -1, *rest)
    q, k, v = per_group.split([spec.num_heads // groups * d, d, d], dim=1)
    return [t.reshape(-1, *rest) for t in (q, k, v)]


def _slice(t: Tensor, tp: int, rank: int, dim: int) -> Tensor:
    if t.shape[dim] % tp:
        raise ValueError(f"cannot split dim {dim} of shape {tuple(t.shape)} evenly over tp={tp}")
    return t.chunk(tp, dim=dim)[rank]


def shard_tp(full: Tensor, pm: ParamMap, spec: ModelSpec, tp: int, rank: int) -> Tensor:
    """Full Megatron tensor -> the slice TP rank `rank` holds."""
    if pm.shard == "none" or tp == 1 and pm.shard != "vocab":
        return full
    if pm.shard == "vocab":
        full = torch.nn.functional.pad(full, (0, 0, 0, spec.padded_vocab_size - full.shape[0]))
        return _slice(full, tp, rank, 0)
    if pm.merge == "gated":  # [gate; up] -> [gate_r; up_r]
        return torch.cat([_slice(part, tp, rank, 0) for part in full.chunk(2, dim=0)], dim=0)
    return _slice(full, tp, rank, 0 if pm.shard == "col" else 1)


def unshard_tp(shards: list[Tensor], pm: ParamMap, spec: ModelSpec) -> Tensor:
    """TP shards (rank order) -> full Megatron tensor (vocabulary padding removed)."""
    if pm.shard == "none":
        return shards[0]
    if pm.shard == "vocab":
        return torch.cat(shards, dim=0)[: spec.vocab_size]
    if pm.merge == "gated":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])], dim=0)
    return torch.cat(shards, dim=0 if pm.shard == "col" else 1)


# ---- reading HF safetensors ----------------------------------------------------------------------------------------
class HFCheckpoint:
    """Lazy reader of a HF safetensors checkpoint (single file or sharded with an index).

    Also accepts experts stored fused (`mlp.experts.gate_up_proj` [E, 2F, H], `mlp.experts.down_proj` [E, H, F], the
    in-memory layout of transformers 5) and serves them under per-expert names.

    Also gpt-oss's fused layout (a `gate_up_proj_bias` beside them): `gate_up_proj` [E, H, 2F] transposed with
    gate and up INTERLEAVED (columns 0, 2, ..: gate), `down_proj` [E, F, H] transposed, `gate_up_proj_bias` [E, 2F]
    interleaved alike, `down_proj_bias` [E, H]: served as per-expert `gate_proj` / `up_proj` / `down_proj` weights
    ([F, H], [H, F]) and biases.
    """

    _EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)")

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.dir}: no *.safetensors files")
        self._handles = {f: safe_open(str(f), framework="pt") for f in files}
        self._where = {k: f for f, h in self._handles.items() for k in h.keys()}

    def keys(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> Tensor:
        if name in self._where:
            return self._handles[self._where[name]].get_tensor(name)
        m = self._EXPERT.fullmatch(name)
        if m:
            prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
            if f"{prefix}.gate_up_proj_bias" in self._where:  # gpt-oss
                return self._gpt_oss_expert(prefix, e, proj, m.group(4))
            if m.group(4) == "bias":
                raise KeyError(f"{self.dir}: tensor {name!r} not found in the safetensors files")
            if proj == "down_proj" and f"{prefix}.down_proj" in self._where:
                return self.get(f"{prefix}.down_proj")[e]
            if proj != "down_proj" and f"{prefix}.gate_up_proj" in self._where:
                return self.get(f"{prefix}.gate_up_proj")[e].chunk(2, dim=0)[proj == "up_proj"]
        raise KeyError(f"{self.dir}: tensor {name!r} not found in the safetensors files")


    def _gpt_oss_expert(self, prefix: str, e: int, proj: str, kind: str) -> Tensor:
        suffix = "_bias" if kind == "bias" else ""
        if proj == "down_proj":
            t = self.get(f"{prefix}.down_proj{suffix}")[e]
            return t if kind == "bias" else t.T.contiguous()
        t = self.get(f"{prefix}.gate_up_proj{suffix}")[e][..., int(proj == "up_proj")::2]
        return t if kind == "bias" else t.T.contiguous()


def skipped_hf_tensors(hf_dir: str | Path, hf_config: dict) -> Iterator[tuple[str, Tensor]]:
    """The tensors of a HF checkpoint that the trainer's model skips by design (`Family.ignored_hf_tensor`: the
    multi-token-prediction layers GLM-4.5 and DeepSeek-V3 carry after the decoder), as stored, in name order: an
    export copies them unchanged, so the exported checkpoint is as complete as the one trained from."""
    family = family_of(hf_config.get("model_type"))
    if family is None:
        return
    base = HFCheckpoint(hf_dir)
    for name in sorted(base.keys()):
        if family.ignored_hf_tensor(hf_config, name):
            yield name, base.get(name)


def _ranks(spec: ModelSpec) -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()


def _hf_names_of_model(model, spec: ModelSpec) -> set[str]:
    """Every HF tensor name the whole model (all TP/EP ranks) reads."""
    names = set()
    for name, _ in named_weights(model):
        if is_lora_param(name):  # adapters are not base-checkpoint tensors (trainer/lora/peft_io.py exports them)
            continue
        pm = param_map(name, spec.arch)
        if pm.local_expert is None:
            names.update(pm.hf_names)
        else:
            for r in range(spec.ep):
                names.update(pm.for_expert(r * spec.num_local_experts + pm.local_expert))
    return names


def _pipeline():
    """(pipeline group, its global ranks in stage order, this rank's stage), or None at PP 1."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_pipeline_model_parallel_world_size() == 1:
        return None
    group = ps.get_pipeline_model_parallel_group()
    return group, torch.distributed.get_process_group_ranks(group), ps.get_pipeline_model_parallel_rank()


def _check_all_used(ckpt: HFCheckpoint, model, spec: ModelSpec) -> None:
    """A checkpoint tensor nobody reads means a feature the converter does not know (a bias, a shared expert).
    Under pipeline parallelism the names every stage reads count (gathered over the pipeline group)."""
    used, family = _hf_names_of_model(model, spec), family_of(spec.arch)
    pipeline = _pipeline()
    if pipeline is not None:
        per_stage = [None] * len(pipeline[1])
        torch.distributed.all_gather_object(per_stage, sorted(used), group=pipeline[0])
        used = set().union(*per_stage)
    fused_experts = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")
    unused = sorted(n for n in ckpt.keys() - used if not fused_experts.fullmatch(n)
                    and not (spec.tied_embeddings and n == "lm_head.weight")
                    and not (family is not None and family.ignored_hf_tensor(spec.hf_config, n)))
    if unused:
        raise ValueError(f"{ckpt.dir}: {len(unused)} tensors have no place in the Megatron model, e.g. {unused[:5]}")


def load_hf_weights(model, spec: ModelSpec, hf_dir: str | Path) -> None:
    """Copy HF safetensors into this rank's TP/EP shards of `model` (its parameters and carried buffers); every
    parameter must be covered and every checkpoint tensor used (ValueError otherwise)."""
    ckpt = HFCheckpoint(hf_dir)
    _check_all_used(ckpt, model, spec)
    tp_rank, ep_rank = _ranks(spec)
    with torch.no_grad():
        for name, param in named_weights(model):
            if is_lora_param(name):
                continue
            pm = param_map(name, spec.arch)
            hf_names = pm.hf_names
            if pm.local_expert is not None:
                hf_names = pm.for_expert(ep_rank * spec.num_local_experts + pm.local_expert)
            full = merge_hf([ckpt.get(n) for n in hf_names], pm.merge, spec)
            local = shard_tp(full, pm, spec, spec.tp, tp_rank)
            if local.shape != param.shape:
                raise ValueError(f"{name}: HF {hf_names} give shape {tuple(local.shape)} on this rank, "
                                 f"Megatron expects {tuple(param.shape)}")
            param.copy_(local.to(param.dtype))
    sync_tied_output(model)


def sync_tied_output(model) -> None:
    """Under pipeline parallelism with tied embeddings: the last stage's output-layer copy set to the first stage's
    (loaded) embedding, as Megatron does at construction (zeros there, summed over the embedding group). Collective
    over the pipeline ranks; a no-op elsewhere. Call after every load of the weights."""
    from megatron.core import parallel_state as ps

    gpt = _gpt(model)
    if (_pipeline() is None or not getattr(gpt, "share_embeddings_and_output_weights", False)
            or not ps.is_rank_in_embedding_group()):
        return
    weight = gpt.shared_embedding_or_output_weight()
    with torch.no_grad():
        if not gpt.pre_process:
            weight.zero_()
        torch.distributed.all_reduce(weight.data, group=ps.get_embedding_group())


# ---- export ----------------------------------------------------------------------------------------------------------
def _all_gather(t: Tensor, group) -> list[Tensor]:
    out = [torch.empty_like(t) for _ in range(group.size())]
    torch.distributed.all_gather(out, t.contiguous(), group=group)
    return out


def _full_hf_tensors(name: str, param: Tensor, spec: ModelSpec) -> list[tuple[str, Tensor]]:
    """One Megatron parameter -> its HF tensors, gathered over TP (dense) or EP (experts). Collective."""
    from megatron.core import parallel_state as ps

    pm = param_map(name, spec.arch)
    t = param.detach()
    if pm.local_expert is not None:
        per_rank = _all_gather(t, ps.get_expert_model_parallel_group()) if spec.ep > 1 else [t]
        out = []
        for r, full in enumerate(per_rank):
            names = pm.for_expert(r * spec.num_local_experts + pm.local_expert)
            out += list(zip(names, split_to_hf(full, pm.merge, spec)))
        return out
    if pm.shard != "none" and spec.tp > 1:
        shards = _all_gather(t, ps.get_tensor_model_parallel_group())
    else:
        shards = [t]
    return list(zip(pm.hf_names, split_to_hf(unshard_tp(shards, pm, spec), pm.merge, spec)))


def _hf_tensors(model, spec: ModelSpec) -> Iterator[tuple[str, Tensor]]:
    """(HF name, full tensor) of every base weight, the same on every rank (collective). Under pipeline
    parallelism stage after stage: the stage's ranks gather each tensor over TP / EP, then its rank broadcasts it
    over its pipeline group (a header object, then the tensors)."""
    # the base weights only (MergedParameters in trainer/lora/peft_io.py folds adapters in: one merged weight
    # alive at a time, so at PP 1 they are read one by one)
    weights = ((name, param) for name, param in named_weights(model) if not is_lora_param(name))
    pipeline = _pipeline()
    if pipeline is None:
        for name, param in weights:
            yield from _full_hf_tensors(name, param, spec)
        return
    mine = list(weights)  # (no LoRA under pipeline parallelism: TrainerConfig.pipeline_problem)
    group, ranks, stage = pipeline
    device = mine[0][1].device
    counts = [None] * len(ranks)
    torch.distributed.all_gather_object(counts, len(mine), group=group)
    for src_stage, src in enumerate(ranks):
        for k in range(counts[src_stage]):
            full = None
            if src_stage == stage:
                full = [(n, t.contiguous()) for n, t in _full_hf_tensors(*mine[k], spec)]
            header = [[(n, tuple(t.shape), t.dtype) for n, t in full] if full is not None else None]
            torch.distributed.broadcast_object_list(header, src=src, group=group)
            if full is None:
                full = [(n, torch.empty(shape, dtype=dtype, device=device)) for n, shape, dtype in header[0]]
            for _, t in full:
                torch.distributed.broadcast(t, src=src, group=group)
            yield from full


def export_hf_weights(model, spec: ModelSpec, bucket_mb: float = 64) -> Iterator[list[tuple[str, Tensor]]]:
    """Yield buckets of full HF tensors (<= bucket_mb each, a larger single tensor travels alone). Collective:
    every rank must iterate it to the end; every rank yields the same tensors. Order: the model's parameter order,
    experts of one layer grouped by local index (under pipeline parallelism: stage by stage, the same order)."""
    limit, bucket, size = bucket_mb * 2**20, [], 0
    family = family_of(spec.arch)
    tensors = _hf_tensors(model, spec)
    for hf_name, tensor in (family.hf_tensors_out(tensors, spec) if family is not None else tensors):
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        # an owned copy: never a view of a parameter the optimizer will change, nor of a larger gathered tensor
        bucket.append((hf_name, tensor.clone(memory_format=torch.contiguous_format)))
        size += nbytes
    if bucket:
        yield bucket


def hf_state_dict_from_megatron(model, spec: ModelSpec) -> dict[str, Tensor]:
    """The whole HF state dict (collective; every rank gets it)."""
    return {name: t for bucket in export_hf_weights(model, spec) for name, t in bucket}


# Files of a HF model directory that are weights (everything else is config/tokenizer and gets copied).
_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth")


def save_hf_checkpoint(model, spec: ModelSpec, out_dir: str | Path, tokenizer_src_dir: str | Path | None = None,
                       max_shard_size: str = "5GB") -> None:
    """Write a HF model directory (safetensors + config.json + tokenizer files). Collective; rank 0 writes.

    Non-weight files (config, generation config, tokenizer) are copied from `tokenizer_src_dir` (default: the
    directory the model was built from); config.json's dtype is set to the exported dtype. The tensors the model
    skips (multi-token-prediction layers) are copied from the directory it was built from, in its dtype."""
    state = hf_state_dict_from_megatron(model, spec)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    dtype = next(iter(state.values())).dtype
    state |= {name: t.to(dtype) for name, t in skipped_hf_tensors(spec.hf_dir, spec.hf_config)}
    write_hf_dir(state, spec.hf_config, tokenizer_src_dir or spec.hf_dir, out_dir, max_shard_size=max_shard_size)


def write_hf_dir(state: dict[str, Tensor], hf_config: dict, src_dir: str | Path, out_dir: str | Path,
                 max_shard_size: str = "5GB") -> Path:
    """Full HF state dict -> a HF model directory: safetensors, config.json (dtype set to the tensors'), and every
    non-weight file of `src_dir` (tokenizer, chat template, generation config). A source without a generation
    config gets one from config.json's bos/eos/pad ids, so `generate` and vLLM stop where training stopped."""
    from huggingface_hub import save_torch_state_dict

    out = write_hf_side_files(hf_config, src_dir, out_dir, next(iter(state.values())).dtype)
    save_torch_state_dict({k: v.cpu() for k, v in state.items()}, out, max_shard_size=max_shard_size)
    return out


def write_hf_side_files(hf_config: dict, src_dir: str | Path, out_dir: str | Path, dtype: torch.dtype) -> Path:
    """Everything of a HF model directory but the weights: config.json (dtype set), and the non-weight files of
    `src_dir` (tokenizer, chat template, generation config; one made from config.json's ids when it has none)."""
    out, src = Path(out_dir), Path(src_dir)
    out.mkdir(parents=True, exist_ok=True)
    skip = {p for pattern in _WEIGHT_FILES for p in src.glob(pattern)}
    for f in src.iterdir():
        if f.is_file() and f not in skip:
            shutil.copy2(f, out / f.name)
    config = dict(hf_config)
    config["dtype" if "dtype" in config or "torch_dtype" not in config else "torch_dtype"] = \
        str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if not (out / "generation_config.json").exists():
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out
