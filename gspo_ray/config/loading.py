"""Reading a job file: YAML, `key.path=value` overrides, validation with one line per invalid field."""
from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from gspo_ray.config.base import ConfigError
from gspo_ray.config.job import JobConfig
from gspo_ray.config.peer_names import peer_hint


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (values parsed as YAML scalars: no eval)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        key, value = item.split("=", 1)
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        try:
            node[parts[-1]] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({getattr(e, 'problem', e)})") from None
    return raw


def section_fields(loc: tuple) -> list[str]:
    """Field names of the config section at `loc` (("trainer",) -> TrainerConfig's), for unknown-key errors."""
    model: type[BaseModel] = JobConfig
    for part in loc:
        f = model.model_fields.get(part) if isinstance(part, str) else None
        subs = [a for a in (f.annotation, *typing.get_args(f.annotation)) if isinstance(a, type)
                and issubclass(a, BaseModel)] if f is not None else []
        if not subs:
            return []
        model = subs[0]
    return list(model.model_fields)


def field_paths(key: str, model: type[BaseModel] = JobConfig, prefix: str = "") -> list[str]:
    """Every dotted field path of the job config whose last part is `key` (`beta` -> ['algorithm.beta'])."""
    out = []
    for name, f in model.model_fields.items():
        if name == key:
            out.append(prefix + name)
        for sub in (f.annotation, *typing.get_args(f.annotation)):
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                out += field_paths(key, sub, f"{prefix}{name}.")
    return out


def _unknown_key(parent: tuple, key: str) -> str:
    """The message of an unknown key: the field a TRL/verl name maps to, the section a misplaced key belongs
    in, or the closest valid key of the section, then the valid keys."""
    hint = peer_hint(key)
    if hint is not None:
        return f"unknown key; {hint}"
    elsewhere = [p for p in field_paths(key) if p.rsplit(".", 1)[0] != ".".join(map(str, parent))]
    if elsewhere:
        return f"unknown key here; the field is {' or '.join(elsewhere)}"
    valid = section_fields(parent)
    close = difflib.get_close_matches(key, valid, 1)
    return ("unknown key" + (f"; did you mean {close[0]!r}?" if close else "")
            + f" (valid keys of {'.'.join(map(str, parent)) or 'a job'}: {', '.join(valid)})")


def _describe(err: dict) -> tuple[str, str]:
    """(field, message) of one pydantic error, saying what would be valid where pydantic does not."""
    loc = ".".join(str(x) for x in err["loc"]) or "(job)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        *parent, key = err["loc"]
        msg = _unknown_key(tuple(parent), str(key))
    elif err["type"] not in ("value_error", "missing") and not isinstance(err.get("input"), (dict, list)):
        msg += f" (got {err.get('input')!r:.80})"
    return loc, msg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Read one YAML job file (or defaults when path is None), apply overrides, validate."""
    raw: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        path = Path(path)
        where = str(path)
        if not path.exists():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f":{mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{path}{at}: not valid YAML: {' '.join(str(e).split())}") from e
        except (UnicodeDecodeError, OSError) as e:
            raise ConfigError(f"{path}: cannot read the job file as UTF-8 text: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    raw = apply_overrides(raw, overrides or [])
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as e:
        problems = [_describe(err) for err in e.errors()]
        sources = [_source(loc, where, overrides or []) for loc, _ in problems]
        lines = [f"  {loc}: {msg}" + (f" (set by {src})" if src != where else "")
                 for src, (loc, msg) in zip(sources, problems)]
        raise ConfigError(f"{where}: invalid config\n" + "\n".join(lines), where, problems, sources) from None
    except OSError as e:  # a path check in a validator (e.g. a file name too long for the OS)
        raise ConfigError(f"{where}: invalid config: {e}") from None


def _source(loc: str, where: str, overrides: list[str]) -> str:
    """Where an invalid field was set: the last command-line override that set it (or a section above it),
    else the job file."""
    for item in reversed(overrides):
        key = item.split("=", 1)[0]
        if loc == key or loc.startswith(key + "."):
            return f"command-line override {item!r}"
    return where


def dump_config(cfg: JobConfig) -> str:
    """The effective config as YAML (defaults filled in)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
