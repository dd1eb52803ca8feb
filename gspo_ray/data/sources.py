"""Prompt rows read from files: JSONL, parquet (verl / slime layout) or a `datasets` save_to_disk directory (TRL).

    rows = read_rows("data/train.parquet", "parquet", prompt_field="prompt",
                     reference_field="reward_model.ground_truth", apply_chat_template=True)
    rows[0].prompt        # [{"role": "user", "content": "..."}]
    rows[0].fields        # the row's other columns, nested as they are: {"data_source": ..., "extra_info": {...}}

`path` is a file or a directory of shards (`*.jsonl` / `*.parquet` under it, read in sorted order; a save_to_disk
directory for hf_disk). Field names may be dotted paths into nested columns (`reward_model.ground_truth`); a key
that itself holds a dot is matched first. Every row is read and checked before anything else happens, and every
problem is collected: `DataRowsError.lines()` gives one line per problem naming the file, the row and the field
(the first ten, then a count). No row is skipped.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from gspo_ray.config.data import FILE_SOURCES, missing_path_message

MAX_PROBLEMS = 10  # problems listed one per line; the rest are counted
CHAT_ROLES = ("system", "user", "assistant", "tool")  # roles a chat template renders
_MISSING = object()


@dataclass(frozen=True)
class PromptRow:
    """One prompt before tokenisation: a string, or chat messages when a chat template is applied."""

    prompt: str | list[dict[str, Any]]
    reference: Any
    origin: str  # where it came from, for error messages: "data/train.jsonl:12" or "builtin:copy/train#12"
    fields: dict[str, Any] = field(default_factory=dict)  # the row's other fields, given to the reward


class DataRowsError(ValueError):
    """Rows that cannot be used: one problem per line, the first MAX_PROBLEMS listed, the rest counted."""

    def __init__(self, problems: list[str]):
        self.problems, self.total = list(problems[:MAX_PROBLEMS]), len(problems)
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        more = self.total - len(self.problems)
        return self.problems + ([f"... and {more} more problem(s) like these"] if more > 0 else [])


def get_field(row: dict[str, Any], path: str) -> Any:
    """`row[path]`, or the value at a dotted path into nested mappings; `_MISSING` when absent."""
    if path in row:
        return row[path]
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def describe_prompt_problem(value: Any, chat: bool) -> str | None:
    """What is wrong with a prompt value (None when it is usable): an empty string, messages without a chat
    template, a message with an unknown role or non-string content, a ShareGPT list, anything else."""
    if isinstance(value, str):
        return "is an empty string" if not value.strip() else None
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
        shown = "an empty list" if value == [] else type(value).__name__
        return f"must be a string or a list of chat messages ({{'role': ..., 'content': ...}}), got {shown}"
    for i, m in enumerate(value):
        if "role" not in m and "from" in m and "value" in m:
            return (f"message {i} has ShareGPT keys 'from'/'value'; chat messages need 'role'/'content' (rename "
                    "them: from -> role with human -> user and gpt -> assistant, value -> content)")
        if "role" not in m or "content" not in m:
            return f"message {i} has keys {sorted(m)}; chat messages need 'role' and 'content'"
        if m["role"] not in CHAT_ROLES:
            return f"message {i} has role {m['role']!r}; valid: {', '.join(CHAT_ROLES)}"
        if not isinstance(m["content"], str):
            return f"message {i} has {type(m['content']).__name__} content; chat content must be a string"
    if not chat:
        return "holds chat messages; set data.apply_chat_template: true to render them with the tokenizer's chat " \
               "template"
    return None


def check_row(row: Any, origin: str, prompt_field: str, reference_field: str | None, chat: bool,
              problems: list[str]) -> PromptRow | None:
    """One row checked: its problems appended (each naming origin and field), or its PromptRow."""
    if not isinstance(row, dict):
        problems.append(f"{origin}: expected a JSON object per row, got {type(row).__name__}")
        return None
    before = len(problems)
    values = {}
    for name, cfg_key in ((prompt_field, "data.prompt_field"), (reference_field, "data.reference_field")):
        if name is None:
            continue
        values[name] = get_field(row, name)
        if values[name] is _MISSING:
            problems.append(f"{origin}: row has no field {name!r} ({cfg_key}); its fields: {', '.join(row) or 'none'}")
        elif values[name] is None:  # parquet and Arrow keep one schema: a key some rows lack is null in them
            problems.append(f"{origin}: field {name!r} ({cfg_key}) is null in this row")
    prompt = values.get(prompt_field, _MISSING)
    if prompt is not _MISSING and prompt is not None:
        problem = describe_prompt_problem(prompt, chat)
        if problem is not None:
            problems.append(f"{origin}: field {prompt_field!r} (data.prompt_field) {problem}")
    if len(problems) > before:
        return None
    reference = values.get(reference_field) if reference_field is not None else None
    fields = {k: v for k, v in row.items() if k not in (prompt_field, reference_field)}
    return PromptRow(prompt, reference, origin, fields)


def _shards(path: Path, suffix: str) -> list[Path]:
    return sorted(p for p in path.rglob(f"*{suffix}") if p.is_file())


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(origin, row or a ProblemText) per non-blank line of each file."""
    for file in [path] if path.is_file() else _shards(path, ".jsonl"):
        with file.open("rb") as f:
            for line_no, raw in enumerate(f, 1):
                origin = f"{file}:{line_no}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield origin, ProblemText(f"not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                              "save the file as UTF-8")
                    continue
                if not line.strip():
                    continue
                try:
                    yield origin, json.loads(line)
                except json.JSONDecodeError as e:
                    yield origin, ProblemText(f"not valid JSON: {e}")


class ProblemText(str):
    """A record that could not be read: the reason, reported against its origin."""


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    for file in [path] if path.is_file() else _shards(path, ".parquet"):
        try:
            table = pq.read_table(file)
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a file that is not parquet
            yield str(file), ProblemText(f"not a readable parquet file ({type(e).__name__}: {e})")
            continue
        # a DataFrame written by pandas keeps a non-default index as a column: it is not the user's data
        index = [c for c in (table.schema.pandas_metadata or {}).get("index_columns", []) if isinstance(c, str)]
        for i, row in enumerate(table.drop_columns(index).to_pylist() if index else table.to_pylist()):
            yield f"{file} row {i}", row


def _hf_disk_records(path: Path) -> Iterator[tuple[str, Any]]:
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise ValueError(f"{path}: a DatasetDict (splits {', '.join(splits) or 'none'}); point data.path / "
                         f"data.eval_path at one split's directory, e.g. {path / (splits[0] if splits else 'train')}")
    import datasets

    try:
        table = datasets.load_from_disk(str(path)).data.table  # the Arrow table: rows as plain Python objects
    except Exception as e:  # datasets raises FileNotFoundError, ArrowInvalid, JSONDecodeError, ... for a broken one
        raise ValueError(f"{path}: not a readable save_to_disk dataset ({type(e).__name__}: {e})") from e
    for i, row in enumerate(table.to_pylist()):
        yield f"{path} row {i}", row


def check_layout(path: Path, source: str) -> None:
    """The path exists and holds what `source` reads; else a one-line FileNotFoundError / ValueError."""
    if not path.exists():
        raise FileNotFoundError(missing_path_message(path))
    if path.is_file():
        if source == "hf_disk":
            raise ValueError(f"{path} is a file; data.source 'hf_disk' reads a directory written by "
                             "datasets' save_to_disk (data.source 'parquet' or 'jsonl' reads a file)")
        return
    saved = (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
    found = {s: bool(_shards(path, f".{s}")) for s in ("parquet", "jsonl")}
    if source == "hf_disk" and saved or source in found and found[source]:
        return
    seen = "a save_to_disk dataset (data.source: hf_disk)" if saved else next(
        (f"{s} files (data.source: {s})" for s, hit in found.items() if hit), None)
    wanted = {"hf_disk": "a save_to_disk dataset (state.json + *.arrow)", "parquet": "*.parquet shards",
              "jsonl": "*.jsonl shards"}[source]
    raise ValueError(f"directory {path} is neither parquet shards nor a save_to_disk dataset: "
                     f"data.source {source!r} reads {wanted}" + (f", and it holds {seen}" if seen else ""))


def read_rows(path: str | Path, source: str = "jsonl", prompt_field: str = "prompt",
              reference_field: str | None = "reference", apply_chat_template: bool = False) -> list[PromptRow]:
    """Every row of a file or directory, checked. Raises DataRowsError (one line per problem), or ValueError /
    FileNotFoundError (the path or its layout)."""
    if source not in FILE_SOURCES:
        raise ValueError(f"data.source {source!r} reads no file; valid: {', '.join(FILE_SOURCES)}")
    path = Path(path)
    check_layout(path, source)
    records = {"jsonl": _jsonl_records, "parquet": _parquet_records, "hf_disk": _hf_disk_records}[source](path)
    rows, problems = [], []
    for origin, record in records:
        if isinstance(record, ProblemText):
            problems.append(f"{origin}: {record}")
            continue
        row = check_row(record, origin, prompt_field, reference_field, apply_chat_template, problems)
        if row is not None:
            rows.append(row)
    if problems:
        raise DataRowsError(problems)
    if not rows:
        raise ValueError(f"{path} has no rows")
    return rows
