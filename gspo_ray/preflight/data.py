"""The job's data: every JSONL row parsed (cheap, before a tokenizer), then both splits tokenised whole."""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from gspo_ray.config import JobConfig
from gspo_ray.preflight.model import PreflightError
from gspo_ray.preflight.report import PreflightReport, one_line

if TYPE_CHECKING:  # gspo_ray.data imports torch: a bad model type or plug-in path is reported before that
    from gspo_ray.data.records import Prompt


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


def parse_data(cfg: JobConfig) -> None:
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


def check_data(cfg: JobConfig, tokenizer: Any, vocab_size: int, report: PreflightReport) -> Prompt:
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
