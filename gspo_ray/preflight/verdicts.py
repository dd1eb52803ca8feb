"""The data preflight's verdicts, remembered in the run directory: a file whose rows and references passed is not
read again by the next launch (`gspo-ray train --resume`) while nothing it depends on changed.

    verdicts = DataVerdicts(run_dir)                     # run_dir/preflight/data_verdicts.json
    key = verdicts.key(path, settings, checks)           # None for a path that cannot be hashed
    if not verdicts.passed(key): ...check... ; verdicts.remember(key, path, rows)
    verdicts.save()                                      # once the whole preflight passed

The key is a SHA-256 over the file's bytes (a directory's: every file under it, by relative path), the settings
that shape what the check sees (source, fields, chat template, the reward mapping) and the source files of the
reward's `check_reference` functions: editing any of them is a new key. Only passes are remembered: a file that
failed is checked afresh, so a timeout on a loaded machine is never kept.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable

VERDICTS_FILE = Path("preflight") / "data_verdicts.json"
VERSION = 1  # bump when what the preflight checks in a row changes
_BLOCK = 1 << 20


def _hash_file(h, path: Path) -> None:
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)


def content_digest(path: Path) -> str:
    """SHA-256 of a file, or of every file under a directory (relative paths and bytes, in sorted order)."""
    h = hashlib.sha256()
    if path.is_dir():
        for sub in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(str(sub.relative_to(path)).encode() + b"\0")
            _hash_file(h, sub)
    else:
        _hash_file(h, path)
    return h.hexdigest()


def _source_digest(fn: Callable) -> str:
    """The bytes of the file that defines `fn` (its name if it has none): a changed check is a new key."""
    try:
        source = inspect.getsourcefile(fn)
    except TypeError:
        source = None
    if source is None or not os.path.isfile(source):
        return f"{getattr(fn, '__module__', '')}:{getattr(fn, '__qualname__', repr(fn))}"
    h = hashlib.sha256()
    _hash_file(h, Path(source))
    return f"{fn.__module__}:{fn.__qualname__}:{h.hexdigest()}"


class DataVerdicts:
    """The passes of earlier preflights in one run directory (a JSON map key -> what was checked)."""

    def __init__(self, run_dir: Path):
        self.path, self._new = Path(run_dir) / VERDICTS_FILE, False
        try:
            self._known = json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet, or a torn write: check again
            self._known = {}
        if not isinstance(self._known, dict):
            self._known = {}

    @staticmethod
    def key(path: Path, settings: dict[str, Any], checks: Iterable[Callable]) -> str | None:
        try:
            digest = content_digest(Path(path))
        except OSError:  # the read reports it
            return None
        material = {"version": VERSION, "path": str(Path(path).resolve()), "content": digest,
                    "settings": settings, "checks": sorted(_source_digest(fn) for fn in checks)}
        return hashlib.sha256(json.dumps(material, sort_keys=True, default=repr).encode()).hexdigest()

    def passed(self, key: str | None) -> bool:
        return key is not None and key in self._known

    def remember(self, key: str | None, path: Path, rows: int) -> None:
        """Record a pass, written by `save`."""
        if key is not None:
            self._known[key] = {"path": str(path), "rows": rows}
            self._new = True

    def save(self) -> None:
        """Write the record if a pass was added (atomically: a torn file is read as empty). The preflight calls it
        once every check passed: a job refused for another reason leaves no run directory behind."""
        if not self._new:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self._known, indent=1, sort_keys=True))
        os.replace(tmp, self.path)
