"""The job's data: every row of its files read and checked (cheap, before a tokenizer; the reward's reference
checks in worker processes with a timeout, references.py; a file that passed before, unchanged, skipped,
verdicts.py), then both splits tokenised whole. Every bad row is reported, one line each naming the field, the
file, the row (first ten, then a count)."""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

from gspo_ray.config import JobConfig
from gspo_ray.preflight.model import PreflightError
from gspo_ray.preflight.references import check_references
from gspo_ray.preflight.report import PreflightReport, one_line
from gspo_ray.preflight.verdicts import DataVerdicts

MAX_PROBLEMS = 10  # problems listed one per line; the rest are counted

if TYPE_CHECKING:  # gspo_ray.data imports torch: a bad model type or plug-in path is reported before that
    from gspo_ray.data.records import Prompt


class PreflightRowsError(PreflightError):
    """Rows that cannot be used: one line per problem naming the field, file, row (the first ten, then a count)."""

    def __init__(self, problems: list[str], total: int):
        shown = problems[:MAX_PROBLEMS]
        self._lines = shown + ([f"... and {total - len(shown)} more problem(s) like these"]
                               if total > len(shown) else [])
        super().__init__("\n".join(self._lines))

    def lines(self) -> list[str]:
        return list(self._lines)


def _split_field(cfg: JobConfig, split: str) -> str:
    if cfg.data.source == "builtin":
        return "data.task"
    return "data.path" if split == "train" else "data.eval_path"


@contextmanager
def _data_errors(cfg: JobConfig, split: str) -> Iterator[None]:
    """The prompt loader's errors (they name file:line and the data.* field) as PreflightErrors naming the field
    of the file they come from: one line per bad row."""
    from gspo_ray.data.sources import DataRowsError

    fld = _split_field(cfg, split)
    try:
        yield
    except DataRowsError as e:
        raise PreflightRowsError([f"{fld}: {line}" for line in e.problems], e.total) from None
    except (ValueError, OSError) as e:
        raise PreflightError(f"{fld}: {one_line(e)}") from None


def _reward_checks(reward_fn: Any) -> list[Callable]:
    """The `check_reference` functions of the reward (one per mapped function of a RoutedReward that has one)."""
    from gspo_ray.envs.reward_calls import RoutedReward

    fns = reward_fn.fns.values() if isinstance(reward_fn, RoutedReward) else [reward_fn]
    return list(dict.fromkeys(c for c in (getattr(fn, "check_reference", None) for fn in fns) if callable(c)))


def _reference_problems(cfg: JobConfig, reward_fn: Any, rows: list) -> list[str]:
    """The reward's view of each row: its data_source maps to a function (rollout.reward.fn as a mapping), and that
    function's `check_reference` (math_verify_reward: math-verify parses it) accepts the row's reference. The
    checks run in worker processes, each reference within data.reference_check_timeout_s (references.py)."""
    from gspo_ray.envs.reward_calls import DATA_SOURCE_FIELD, RoutedReward

    checks = _reward_checks(reward_fn)
    index = {id(c): i for i, c in enumerate(checks)}
    problems: list[tuple[int, str]] = []
    items, item_rows = [], []
    for n, row in enumerate(rows):
        fn = reward_fn
        if isinstance(reward_fn, RoutedReward):
            source = row.fields.get(DATA_SOURCE_FIELD)
            key = reward_fn.route(source)
            if key is None:
                got = f"is {source!r}" if DATA_SOURCE_FIELD in row.fields else "is missing"
                problems.append((n, f"{row.origin}: field {DATA_SOURCE_FIELD!r} {got}, which rollout.reward.fn maps "
                                    f"to no reward function (mapped: {', '.join(reward_fn.routes)}; '*' maps any "
                                    "other)"))
                continue
            fn = reward_fn.fns[key]
        check = getattr(fn, "check_reference", None)
        if callable(check):
            items.append((index[id(check)], row.reference))
            item_rows.append(n)
    found = check_references(checks, items, cfg.data.reference_check_timeout_s,
                             timeout_field="data.reference_check_timeout_s")
    field = cfg.data.reference_field
    problems += [(n, f"{rows[n].origin}: field {field!r} (data.reference_field): {p}")
                 for n, p in zip(item_rows, found) if p]
    return [line for _, line in sorted(problems)]


def parse_data(cfg: JobConfig, reward_fn: Any = None, verdicts: DataVerdicts | None = None) -> None:
    """Every row of the data files read and checked, before any tokenizer is loaded (the cheap half): the fields,
    the prompts' types, messages and roles, and the reward's view of each row (`_reference_problems`). Every
    problem of both files is collected: one line each, then exit 2. `verdicts`: the run directory's record of
    files that passed (verdicts.py); a file it holds, unchanged, is not read again, and one that passes is added."""
    from gspo_ray.data.sources import DataRowsError, read_rows

    d = cfg.data
    if d.source == "builtin":
        return
    checked = reward_fn is not None and cfg.rollout.multi_turn is None
    settings = {"source": d.source, "prompt_field": d.prompt_field, "reference_field": d.reference_field,
                "apply_chat_template": d.apply_chat_template, "reward": cfg.rollout.reward.fn if checked else None}
    problems, total = [], 0
    for split, path in (("train", d.path), ("eval", d.eval_path)):
        if path is None:
            continue
        key = verdicts.key(path, settings, _reward_checks(reward_fn) if checked else []) if verdicts else None
        if verdicts is not None and verdicts.passed(key):
            continue
        fld = _split_field(cfg, split)
        with _data_errors(cfg, split):
            try:
                rows = read_rows(path, d.source, d.prompt_field, d.reference_field, d.apply_chat_template)
            except DataRowsError as e:
                problems += [f"{fld}: {line}" for line in e.problems]
                total += e.total
                continue
        found = _reference_problems(cfg, reward_fn, rows) if checked else []
        problems += [f"{fld}: {line}" for line in found]
        total += len(found)
        if not found and verdicts is not None:
            verdicts.remember(key, path, len(rows))
    if total:
        raise PreflightRowsError(problems, total)


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
            fld = _split_field(cfg, split)
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
