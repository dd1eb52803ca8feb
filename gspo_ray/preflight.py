"""Preflight: every check of a job's input that can run before Ray or any engine starts.

    gspo-ray config validate job.yaml          # runs it, one line per check
    gspo-ray train job.yaml                    # runs it first; a bad input ends in one line and exit 2

    report = run_preflight(cfg)                # PreflightError (one line naming the field / file) or a report
    print("\\n".join(report.lines()))

Cheapest first, so the common mistakes end in a second or two: the model directory's config.json and safetensors
headers (architecture supported by the converter and the engine, weights present and sized to the vocabulary),
the plug-ins (reward function / environment class import, with the protocol's signature), every JSONL row parsed;
then what imports torch / transformers: the converter's TP x EP layout, the tokenizer (loads, EOS, fits the
embedding, chat template when asked), the data tokenised whole (prompts longer than `max_model_len -
max_new_tokens` named), one dry call of the reward on a dummy completion (the first prompt's reference, stopped)
and of the environment's `reset`, their return types checked. Plug-in code runs on a daemon thread with a timeout.
A `model.tiny` job has no directory yet: the config it will be built from is checked, the directory is not.

Nothing here writes to disk, and nothing imports Ray, vLLM or Megatron.
"""
from __future__ import annotations

import inspect
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from gspo_ray.config import JobConfig
from gspo_ray.plugins import PluginError, resolve_callable
from gspo_ray.preflight_model import (PreflightError, check_architecture, check_converter_spec, check_engine_limits,
                                      check_model_dir, check_tokenizer, load_checked_tokenizer)

if TYPE_CHECKING:  # gspo_ray.data imports torch: a bad model type or plug-in path is reported before that
    from gspo_ray.data.records import Prompt

__all__ = ["PreflightError", "PreflightReport", "run_preflight", "call_with_timeout"]

IMPORT_TIMEOUT_S = 60.0  # a plug-in module may import heavy libraries; one that hangs still ends the preflight
_MAX_LINE = 300


def one_line(e: BaseException | str, limit: int = _MAX_LINE) -> str:
    """An error message folded onto one line and cut to `limit` characters."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class Check:
    name: str
    status: str  # "ok" | "skipped" | "warning"
    detail: str


@dataclass
class PreflightReport:
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, name: str, status: str, detail: str) -> None:
        self.checks.append(Check(name, status, detail))

    def lines(self) -> list[str]:
        return [f"  {c.name:<10} {c.status:<8} {c.detail}" for c in self.checks]

    def summary(self) -> str:
        notes = [f"{c.name} {c.status}" for c in self.checks if c.status != "ok"]
        return f"preflight ok in {self.seconds:.1f} s" + (f" ({', '.join(notes)})" if notes else "")


def call_with_timeout(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """fn() on a daemon thread. PreflightError when it raises (plug-in errors keep their own message) or runs
    past `timeout_s` (the thread cannot be killed; it is left behind and never blocks the process's exit)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # user code may raise anything, SystemExit included
            box["error"] = e

    thread = threading.Thread(target=run, name="preflight-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise PreflightError(f"{what} did not return within {timeout_s:g} s")
    error = box.get("error")
    if isinstance(error, (PreflightError, PluginError)):
        raise PreflightError(one_line(error)) from error
    if error is not None:
        raise PreflightError(f"{what} raised {type(error).__name__}: {one_line(error, 200)}") from error
    return box["value"]


# ---- model -----------------------------------------------------------------------------------------------------------
def _packaged_dir(cfg: JobConfig) -> Path | None:
    """Where model.packaged is imported (models/gguf.py), once that import is complete; else None."""
    from gspo_ray.models.gguf import STAMP

    out = cfg.logging.out_dir / "models" / cfg.model.packaged
    return out if (out / STAMP).is_file() and (out / "model.safetensors").is_file() else None


def _model_facts(cfg: JobConfig, report: PreflightReport):
    """File checks of the model directory (no torch, no tokenizer yet); None while it does not exist yet
    (model.tiny is built, model.packaged imported, when training starts)."""
    r, path = cfg.rollout, cfg.model.path
    if getattr(cfg.model, "packaged", None) is not None:
        path = _packaged_dir(cfg)
        if path is None:
            report.add("model", "skipped", f"model.packaged ({cfg.model.packaged}) is imported into "
                                           f"{cfg.logging.out_dir / 'models'} when training starts: directory "
                                           "checks skipped, its tokenizer read from the GGUF file")
            return None
    elif path is None:  # model.tiny: its config is checked last, after the dry calls (see run_preflight)
        report.add("model", "skipped", f"model.tiny ({cfg.model.tiny.arch}) is built into {cfg.run_dir / 'model'} "
                                       "when training starts: directory checks skipped, its config checked")
        return None
    facts = check_model_dir(path, max_model_len=r.max_model_len, engine_on_cpu=r.num_gpus_per_worker == 0)
    arch = facts.hf_config.get("model_type")
    report.add("model", "ok", f"{facts.path}: {arch}, vocab {facts.vocab_size}, "
                              f"{facts.num_weight_files} safetensors file(s)")
    return facts


def _check_tiny_config(cfg: JobConfig, on_cpu: bool) -> None:
    from gspo_ray.models.tiny import build_config

    tiny, where = cfg.model.tiny, f"model.tiny ({cfg.model.tiny.arch})"
    try:  # the vocabulary size does not matter to any check below
        hf = build_config(tiny.arch, vocab_size=32, hidden=tiny.hidden, layers=tiny.layers, experts=tiny.experts,
                          top_k=tiny.top_k).to_dict()
    except ValueError as e:
        raise PreflightError(f"{where}: {one_line(e)}") from None
    check_architecture(where, hf)
    check_converter_spec(where, hf, cfg.trainer.tp, cfg.trainer.ep)
    check_engine_limits(where, hf, cfg.rollout.max_model_len, on_cpu)


def _tokenizer(cfg: JobConfig, facts, report: PreflightReport) -> tuple[Any, int]:
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
    check_converter_spec(facts.path, facts.hf_config, cfg.trainer.tp, cfg.trainer.ep)
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


# ---- data ------------------------------------------------------------------------------------------------------------
def _first_bad_utf8_line(path: Path) -> str:
    with Path(path).open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"{path}:{line_no}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
    return f"{path}: not UTF-8"


@contextmanager
def _data_errors(cfg: JobConfig, split: str) -> Iterator[None]:
    """The prompt loader's errors (they name file:line and the data.* field) as PreflightErrors naming the field
    of the file they come from."""
    d = cfg.data
    fld = ("data.path" if split == "train" else "data.eval_path") if d.source == "jsonl" else "data.task"
    try:
        yield
    except UnicodeDecodeError:
        path = d.path if split == "train" else d.eval_path
        raise PreflightError(f"{fld}: {_first_bad_utf8_line(path)}; save the file as UTF-8") from None
    except (ValueError, OSError) as e:
        raise PreflightError(f"{fld}: {one_line(e)}") from None


def _parse_data(cfg: JobConfig) -> None:
    """Every JSONL row parsed and its fields checked, before any tokenizer is loaded (the cheap half)."""
    from gspo_ray.data.prompts import read_jsonl_rows

    d = cfg.data
    for split, path in (("train", d.path), ("eval", d.eval_path)):
        if d.source == "jsonl" and path is not None:
            with _data_errors(cfg, split):
                read_jsonl_rows(path, d.prompt_field, d.reference_field, d.apply_chat_template)


def _load_split(cfg: JobConfig, tokenizer: Any, split: str):
    from gspo_ray.data.prompts import PromptSource

    r = cfg.rollout
    limits = dict(max_new_tokens=r.max_new_tokens, max_model_len=r.max_model_len)
    with _data_errors(cfg, split), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        source = PromptSource.from_config(cfg.data, tokenizer, split=split, **limits)
        prompts = source.validate().prompts() if source is not None else []
    return source, prompts, [one_line(w.message) for w in caught]


def _check_data(cfg: JobConfig, tokenizer: Any, vocab_size: int, report: PreflightReport) -> Prompt:
    """Both splits read and tokenised whole; returns the first training prompt (for the dry calls)."""
    room = cfg.rollout.max_model_len - cfg.rollout.max_new_tokens
    first = None
    for split in ("train", "eval"):
        source, prompts, notes = _load_split(cfg, tokenizer, split)
        if source is None:
            report.add(f"data/{split}", "skipped", "no held-out set (data.eval_path unset or data.num_eval 0)")
            continue
        past = [p for p in prompts if max(p.prompt_ids) >= vocab_size]
        if past:
            fld = "data.task" if cfg.data.source == "builtin" else ("data.path" if split == "train"
                                                                     else "data.eval_path")
            raise PreflightError(f"{fld}: {past[0].meta['origin']}: token id {max(past[0].prompt_ids)} has no "
                                 f"embedding (the model's vocab_size is {vocab_size}; {len(past)} prompt(s) "
                                 "affected): tokenizer and model do not agree")
        longest = max(len(p.prompt_ids) for p in prompts)
        report.add(f"data/{split}", "ok", f"{source.name}: {len(prompts)} prompts, longest {longest} tokens "
                                          f"(room {room} = rollout.max_model_len - rollout.max_new_tokens)")
        for note in notes:
            report.add(f"data/{split}", "warning", note)
        first = first or prompts[0]
    return first


# ---- plug-ins --------------------------------------------------------------------------------------------------------
def _import_reward(cfg: JobConfig, import_timeout_s: float) -> Callable:
    r = cfg.rollout.reward
    fn = call_with_timeout(lambda: resolve_callable(r.fn, "rollout.reward.fn"), import_timeout_s,
                           f"rollout.reward.fn: importing {r.fn!r}")
    from gspo_ray.rollout.scoring import build_call_kwargs  # no engine; after the user's import (this one is torch)

    try:
        build_call_kwargs(fn, dict(r.kwargs), "rollout.reward")
    except PluginError as e:
        raise PreflightError(f"{one_line(e)}; protocol: fn(completion, reference, **context) -> float | dict "
                             "(gspo_ray/envs/rewards.py)") from None
    return fn


def _import_env(cfg: JobConfig, import_timeout_s: float) -> type | None:
    from gspo_ray.envs.multiturn import check_env

    mt = cfg.rollout.multi_turn
    if mt is None:
        return None
    if "tokenizer" in mt.kwargs:
        raise PreflightError("rollout.multi_turn.kwargs: may not set 'tokenizer'; the runner passes the model's")
    return call_with_timeout(lambda: check_env(mt.env, "rollout.multi_turn.env"), import_timeout_s,
                             f"rollout.multi_turn.env: importing {mt.env!r}")


def _dry_reward(cfg: JobConfig, fn: Callable, tokenizer: Any, prompt: Prompt, report: PreflightReport) -> None:
    """Score the first prompt's reference as if the model had answered it and stopped."""
    from gspo_ray.rollout.scoring import build_call_kwargs, to_outcome

    r = cfg.rollout.reward
    ref = prompt.reference
    ids = list(tokenizer.encode("" if ref is None else str(ref), add_special_tokens=False))
    ids = ids[: cfg.rollout.max_new_tokens - 1] + [tokenizer.eos_token_id]
    text = tokenizer.decode(ids[:-1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    context = {"completion_ids": ids, "finish_reason": "stop", "eos_found": True, "prompt_text": prompt.text,
               "meta": prompt.meta}
    kwargs = build_call_kwargs(fn, dict(r.kwargs), "rollout.reward")(context)
    where = f"rollout.reward.fn: {r.fn!r} on a dry call (completion {text[:40]!r}, reference {str(ref)[:40]!r})"
    start = time.perf_counter()
    value = call_with_timeout(lambda: fn(text, ref, **kwargs), r.timeout_s,
                              f"{where} (rollout.reward.timeout_s)")
    try:
        reward, _, _ = to_outcome(value, len(ids))
    except (TypeError, ValueError) as e:
        raise PreflightError(f"{where}: {one_line(e)}") from None
    report.add("reward", "ok", f"{r.fn}: {reward:g} for the reference answer "
                               f"({time.perf_counter() - start:.2f} s of {r.timeout_s:g} s allowed)")


def _dry_env(cfg: JobConfig, env_cls: type, tokenizer: Any, prompt: Prompt, report: PreflightReport) -> None:
    """Build one environment and reset it on the first prompt; the observation must be ids or round-trip text."""
    from gspo_ray.envs.multiturn import EnvError, check_observation

    mt = cfg.rollout.multi_turn
    name = f"rollout.multi_turn.env: {mt.env!r}"
    try:
        inspect.signature(env_cls).bind(tokenizer=tokenizer, **mt.kwargs)
    except TypeError as e:
        raise PreflightError(f"rollout.multi_turn.kwargs: {env_cls.__name__}(tokenizer=..., **kwargs) does not fit "
                             f"its signature {inspect.signature(env_cls)}: {e}") from None
    except ValueError:  # no signature to inspect (builtins): the call below tells
        pass
    env = call_with_timeout(lambda: env_cls(tokenizer=tokenizer, **mt.kwargs), mt.step_timeout_s,
                            f"{name}: building it (rollout.multi_turn.step_timeout_s)")
    for method, args in (("reset", (prompt, 0)), ("step", ([0], ""))):
        try:
            inspect.signature(getattr(env, method)).bind(*args)
        except TypeError as e:
            raise PreflightError(f"{name}: {method}{inspect.signature(getattr(env, method))} does not take the "
                                 f"protocol's arguments ({e}); protocol: reset(prompt, seed), "
                                 "step(action_ids, action_text)") from None
        except ValueError:
            pass
    obs = call_with_timeout(lambda: env.reset(prompt, 0), mt.step_timeout_s,
                            f"{name}: reset on a dry call (rollout.multi_turn.step_timeout_s)")
    try:
        ids = check_observation(obs, tokenizer, len(tokenizer), "reset")  # the vocabulary bound the runner uses
    except EnvError as e:
        raise PreflightError(f"{name}: {env_cls.__name__}.reset on a dry call: {one_line(e)}; valid: token ids "
                             "(list[int]) or text the tokenizer encodes and decodes back exactly") from None
    report.add("env", "ok", f"{mt.env}: reset gave a {len(ids)}-token observation")


# ---- the whole preflight ---------------------------------------------------------------------------------------
def run_preflight(cfg: JobConfig, *, import_timeout_s: float = IMPORT_TIMEOUT_S) -> PreflightReport:
    """Check everything about `cfg`'s input that can be checked without Ray or an engine. Raises PreflightError
    (one line naming the field, file and line, and what would be valid) on the first problem."""
    start = time.perf_counter()
    report = PreflightReport()
    facts = _model_facts(cfg, report)
    reward_fn = _import_reward(cfg, import_timeout_s)
    env_cls = _import_env(cfg, import_timeout_s)
    _parse_data(cfg)
    tokenizer, vocab_size = _tokenizer(cfg, facts, report)
    prompt = _check_data(cfg, tokenizer, vocab_size, report)
    if env_cls is None:
        _dry_reward(cfg, reward_fn, tokenizer, prompt, report)
    else:  # episodes are scored by the environment's step rewards; reward.fn is only imported and checked
        report.add("reward", "skipped", f"{cfg.rollout.reward.fn}: imported and checked, not called "
                                        "(multi-turn rewards come from the environment)")
        _dry_env(cfg, env_cls, tokenizer, prompt, report)
    if facts is None and cfg.model.tiny is not None:  # last: importing a transformers config class takes seconds
        _check_tiny_config(cfg, cfg.rollout.num_gpus_per_worker == 0)
    report.seconds = time.perf_counter() - start
    return report
