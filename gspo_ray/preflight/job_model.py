"""The job's model and tokenizer: the model directory's file checks, a tiny model's config, the tokenizer
(packaged, tiny or from the directory)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from gspo_ray.config import JobConfig
from gspo_ray.models.cache import packaged_model_dir
from gspo_ray.preflight.model import (PreflightError, check_architecture, check_context_parallel,
                                     check_converter_spec, check_engine_limits,
                                     check_engine_parallel, check_model_dir, check_tokenizer, load_checked_tokenizer,
                                     node_device_count)
from gspo_ray.preflight.report import PreflightReport, one_line


def _packaged_dir(cfg: JobConfig) -> Path | None:
    """Where model.packaged is imported (models/gguf.py), once that import is complete; else None."""
    from gspo_ray.models.gguf import is_imported

    out = packaged_model_dir(cfg.model.packaged, cfg.model.cache_dir)
    return out if is_imported(out) else None


def model_facts(cfg: JobConfig, report: PreflightReport, require_weights: bool = True):
    """File checks of the model directory (no torch, no tokenizer yet); None while it does not exist yet
    (model.tiny is built, model.packaged imported, when training starts)."""
    r, path = cfg.rollout, cfg.model.path
    if getattr(cfg.model, "packaged", None) is not None:
        path = _packaged_dir(cfg)
        if path is None:
            where = packaged_model_dir(cfg.model.packaged, cfg.model.cache_dir)
            report.add("model", "skipped", f"model.packaged ({cfg.model.packaged}) is imported once into {where} "
                                           "(the model cache) when training starts: directory checks skipped, its "
                                           "tokenizer read from the GGUF file")
            return None
    elif path is None:  # model.tiny: its config is checked last, after the dry calls (see run_preflight)
        report.add("model", "skipped", f"model.tiny ({cfg.model.tiny.arch}) is built into {cfg.run_dir / 'model'} "
                                       "when training starts: directory checks skipped, its config checked")
        return None
    facts = check_model_dir(path, max_model_len=r.max_model_len, engine_on_cpu=r.num_gpus_per_worker == 0,
                            require_weights=require_weights)
    check_rollout_parallel(cfg, facts.path, facts.hf_config)
    arch = facts.hf_config.get("model_type")
    report.add("model", "ok", f"{facts.path}: {arch}, vocab {facts.vocab_size}, "
                              f"{facts.num_weight_files} safetensors file(s)")
    if not facts.num_weight_files:
        report.add("weights", "warning", f"{facts.path}: no *.safetensors: weights not checked (config.json and "
                                         "the tokenizer are enough to validate and plan; training needs them)")
    return facts


def check_tiny_config(cfg: JobConfig, on_cpu: bool) -> dict:
    """The tiny model's config (as it will be built) checked like a directory's config.json; returns it."""
    from gspo_ray.models.tiny import build_config

    tiny, where = cfg.model.tiny, f"model.tiny ({cfg.model.tiny.arch})"
    try:  # the vocabulary size does not matter to any check below
        hf = build_config(tiny.arch, vocab_size=32, hidden=tiny.hidden, layers=tiny.layers, experts=tiny.experts,
                          top_k=tiny.top_k).to_dict()
    except ValueError as e:
        raise PreflightError(f"{where}: {one_line(e)}") from None
    check_architecture(where, hf)
    check_trainer_layout(cfg, where, hf)
    check_engine_limits(where, hf, cfg.rollout.max_model_len, on_cpu)
    check_rollout_parallel(cfg, where, hf)
    return hf


def check_trainer_layout(cfg: JobConfig, where, hf_config: dict) -> None:
    """The converter's TP x EP check, trainer.cp against the model (preflight/model.check_context_parallel), and
    trainer.pp against the model: it must divide the layers, the features
    not built under pipeline parallelism are off (TrainerConfig.pipeline_problem, here with the model's experts
    known), and pushes go by a transport that gathers every stage (the nccl / ipc senders plan per rank)."""
    from gspo_ray.rollout.weight_transfer import job_weight_transfer
    from gspo_ray.trainer.model_spec import spec_from_hf_config

    t = cfg.trainer
    check_converter_spec(where, hf_config, t.tp, t.ep)
    check_context_parallel(where, hf_config, t)
    check_family_paths(cfg, where, hf_config)
    if t.pp == 1:
        return
    spec = spec_from_hf_config(hf_config, str(where), tp=t.tp, ep=t.ep)
    if spec.num_layers % t.pp:
        raise PreflightError(f"{where}: trainer.pp ({t.pp}) must divide the model's {spec.num_layers} layers "
                             "(num_hidden_layers)")
    problem = t.pipeline_problem(spec.is_moe)
    if problem:
        raise PreflightError(f"{where}: {problem}")
    transfer = job_weight_transfer(cfg)
    if transfer in ("nccl", "ipc"):
        raise PreflightError(f"rollout.weight_transfer {transfer} cannot push from trainer.pp ({t.pp}) > 1 (its "
                             "sender gathers no pipeline stages): set rollout.weight_transfer: object_store")


def check_family_paths(cfg: JobConfig, where, hf_config: dict) -> None:
    """What the model's family has not built: vLLM's nccl / ipc senders for a checkpoint whose experts the export
    fuses (gpt-oss; rollout.weight_transfer auto resolves to them on CUDA), and Transformer Engine's layers where
    their names are not mapped (trainer.use_te true; auto builds the local spec for such a family)."""
    from gspo_ray.rollout.weight_transfer import job_weight_transfer
    from gspo_ray.trainer.families import family_of

    family, model_type = family_of(hf_config.get("model_type")), hf_config.get("model_type")
    transfer = job_weight_transfer(cfg)
    if family.fuses_experts_on_export and transfer in ("nccl", "ipc"):
        asked = "" if cfg.rollout.weight_transfer == transfer else f" (auto resolves to {transfer} on CUDA)"
        raise PreflightError(f"{where}: rollout.weight_transfer {transfer}{asked} cannot push {model_type} (its "
                             "checkpoint's fused experts are made by the trainer's export only): set "
                             "rollout.weight_transfer: object_store")
    if cfg.trainer.use_te is True and not family.te_spec:
        raise PreflightError(f"{where}: trainer.use_te true is not built for {model_type} (Transformer Engine's "
                             "layer names are not mapped for it); valid: auto (the local spec), false")


def check_rollout_parallel(cfg: JobConfig, where, hf_config: dict) -> None:
    """rollout.tensor_parallel_size against the model and this machine (check_engine_parallel)."""
    r = cfg.rollout
    on_cpu = r.num_gpus_per_worker == 0
    if r.tensor_parallel_size > 1:
        check_engine_parallel(where, hf_config, r.tensor_parallel_size, r.enable_expert_parallel,
                              node_device_count(on_cpu), "core" if on_cpu else "GPU")


def checked_tokenizer(cfg: JobConfig, facts, report: PreflightReport) -> tuple[Any, int]:
    """The converter's layout check and the tokenizer (the first steps that import torch / transformers).
    Returns the tokenizer and the model's vocabulary size."""
    chat = cfg.data.apply_chat_template
    if facts is None and getattr(cfg.model, "packaged", None) is not None:
        tok = _packaged_tokenizer(cfg.model.packaged, chat)
        report.add("tokenizer", "ok", f"{type(tok).__name__} from the GGUF file, {len(tok)} tokens")
        return tok, len(tok)
    if facts is None:
        from gspo_ray.models.tiny import build_tokenizer

        tok = build_tokenizer()
        check_tokenizer(tok, len(tok), f"model.tiny ({cfg.model.tiny.arch})", chat)
        report.add("tokenizer", "ok", f"the tiny model's character tokenizer ({len(tok)} tokens)")
        return tok, len(tok)
    check_trainer_layout(cfg, facts.path, facts.hf_config)
    tok, notes = load_checked_tokenizer(facts, chat)
    template = ", chat template" if getattr(tok, "chat_template", None) else ""
    report.add("tokenizer", "ok", f"{type(tok).__name__}, {len(tok)} tokens, eos {tok.eos_token!r}{template}")
    for note in notes:
        report.add("tokenizer", "warning", note)
    return tok, facts.vocab_size


def _packaged_tokenizer(name: str, chat: bool) -> Any:
    from transformers import AutoTokenizer

    from gspo_ray.models.gguf import packaged_gguf

    try:
        gguf = packaged_gguf()
    except FileNotFoundError as e:
        raise PreflightError(f"model.packaged: {name}: {one_line(e)}") from None
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    check_tokenizer(tok, len(tok), f"model.packaged ({name})", chat)
    return tok
