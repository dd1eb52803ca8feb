"""Preflight: every check of a job's input that can run before Ray or any engine starts.

    gspo-ray config validate job.yaml          # runs it, one line per check
    gspo-ray train job.yaml                    # runs it first; a bad input ends in one line and exit 2

    report = run_preflight(cfg)                # PreflightError (one line naming the field / file) or a report
    print("\\n".join(report.lines()))

Cheapest first, so the common mistakes end in a second or two: the model directory's config.json and safetensors
headers (architecture supported by the converter and the engine, weights present and sized to the vocabulary),
the plug-ins (reward function / environment class import, with the protocol's signature), every data row read
(JSONL, parquet, save_to_disk: fields, prompt types, messages, a data_source mapped to a reward, references the
reward can parse);
then what imports torch / transformers: the converter's TP x EP layout, the tokenizer (loads, EOS, fits the
embedding, chat template when asked), the data tokenised whole (prompts longer than `max_model_len -
max_new_tokens` named), one dry call of the reward on a dummy completion (the first prompt's reference, stopped)
and of the environment's `reset`, their return types checked. Plug-in code runs on a daemon thread with a timeout.
A `model.tiny` job has no directory yet: the config it will be built from is checked, the directory is not.

Nothing here imports Ray, vLLM or Megatron. Nothing writes to disk but, when `remember_in` is given (`gspo-ray
train`: the run directory), the data files that passed (preflight/verdicts.py: a `--resume` reads them no more).
"""
from __future__ import annotations

import time
from pathlib import Path

from gspo_ray.config import JobConfig
from gspo_ray.preflight.data import check_data, parse_data
from gspo_ray.preflight.job_model import check_tiny_config, checked_tokenizer, model_facts
from gspo_ray.preflight.lora import check_lora
from gspo_ray.preflight.memory import check_memory
from gspo_ray.preflight.model import PreflightError
from gspo_ray.preflight.plugins import dry_agent, dry_env, dry_reward, import_agent, import_env, import_reward
from gspo_ray.preflight.push_bound import check_push_timeout
from gspo_ray.preflight.report import IMPORT_TIMEOUT_S, PreflightReport
from gspo_ray.preflight.verdicts import DataVerdicts
from gspo_ray.preflight.routes import check_routes
from gspo_ray.rollout.engine_env import describe_engines
from gspo_ray.rollout.weight_transfer import job_weight_transfer


def check_use_te(use_te, attention_kernel: str = "sdpa") -> None:
    """trainer.use_te: true needs CUDA and an importable transformer_engine here (auto falls back by itself);
    trainer.attention_kernel te_thd needs them too, and the TE layers (use_te not false)."""
    from gspo_ray.trainer.model_spec import te_missing

    if use_te is True and te_missing():
        raise PreflightError(f"trainer.use_te: true needs CUDA and transformer_engine: {te_missing()}; valid: auto, "
                             "false")
    if attention_kernel == "te_thd" and (use_te is False or te_missing()):
        why = "trainer.use_te is false" if use_te is False else te_missing()
        raise PreflightError(f"trainer.attention_kernel: te_thd needs Transformer Engine's layers on CUDA: {why}; "
                             "valid here: sdpa")


def check_transfer_devices(cfg: JobConfig) -> None:
    """rollout.weight_transfer nccl / ipc need CUDA on both sides (rollout and trainer num_gpus_per_worker > 0) and
    no trainer.lora with serve adapter (adapters go through vLLM's LoRA API; merged pushes may use nccl / ipc)."""
    try:
        job_weight_transfer(cfg)
    except ValueError as e:
        raise PreflightError(str(e)) from None


def anchor_line(recompute: bool, gap_every: int) -> str:
    """Which log-probs anchor GSPO's ratio in this job (the preflight's `anchor` line)."""
    if recompute:
        return "recomputed by the trainer (coordinator.recompute_old_logprobs: one old-policy forward per batch)"
    return ("the engine's log-probs, gap to the trainer's checked at step 1" +
            (f" and every {gap_every} steps" if gap_every else "") + " (coordinator.anchor_gap_every)")


def run_preflight(cfg: JobConfig, *, import_timeout_s: float = IMPORT_TIMEOUT_S,
                  remember_in: Path | None = None, require_weights: bool = True) -> PreflightReport:
    """Check everything about `cfg`'s input that can be checked without Ray or an engine. Raises PreflightError
    (one line naming the field, file and line, and what would be valid) on the first problem. `remember_in`: a
    run directory whose record of data files that passed is read and added to. `require_weights` False (`config
    validate`, `plan`): a model directory with config.json and a tokenizer but no *.safetensors passes, its
    weights said to be unchecked."""
    start = time.perf_counter()
    report = PreflightReport()
    check_use_te(cfg.trainer.use_te, cfg.trainer.attention_kernel)
    check_transfer_devices(cfg)
    facts = model_facts(cfg, report, require_weights)
    check_push_timeout(cfg, facts.path if facts is not None else None)
    check_routes(cfg, facts.hf_config if facts is not None else None, f"model.path ({cfg.model.path})")
    check_memory(cfg, facts.hf_config if facts is not None else None, report)
    if facts is not None or cfg.model.tiny is None:  # a tiny model's adapters are checked with its config below
        check_lora(cfg, facts.hf_config if facts is not None else None, report)
    reward_fn = import_reward(cfg, import_timeout_s)
    env_cls = import_env(cfg, import_timeout_s)
    agent_fn = import_agent(cfg, import_timeout_s)
    verdicts = DataVerdicts(remember_in) if remember_in is not None else None
    parse_data(cfg, reward_fn, verdicts)
    tokenizer, vocab_size = checked_tokenizer(cfg, facts, report)
    prompt = check_data(cfg, tokenizer, vocab_size, report)
    if agent_fn is not None:  # the agent's return value is the reward
        report.add("reward", "skipped", f"{cfg.rollout.reward.fn}: imported and checked, not called "
                                        "(agent episodes' rewards come from the agent)")
        dry_agent(cfg, agent_fn, prompt, report)
    elif env_cls is None:
        dry_reward(cfg, reward_fn, tokenizer, prompt, report)
    else:  # episodes are scored by the environment's step rewards; reward.fn is only imported and checked
        report.add("reward", "skipped", f"{cfg.rollout.reward.fn}: imported and checked, not called "
                                        "(multi-turn rewards come from the environment)")
        dry_env(cfg, env_cls, tokenizer, prompt, report)
    if facts is None and cfg.model.tiny is not None:  # last: importing a transformers config class takes seconds
        check_lora(cfg, check_tiny_config(cfg, cfg.rollout.num_gpus_per_worker == 0), report)
    r = cfg.rollout
    transport = job_weight_transfer(cfg)  # checked above
    report.add("engines", "ok", describe_engines(r.tensor_parallel_size, r.enable_expert_parallel,
                                                 r.num_gpus_per_worker > 0, transport))
    report.add("anchor", "ok", anchor_line(cfg.coordinator.recompute_old_logprobs,
                                           cfg.coordinator.anchor_gap_every))
    if verdicts is not None:  # every check passed: the data files' verdicts may be kept
        verdicts.save()
    report.seconds = time.perf_counter() - start
    return report
