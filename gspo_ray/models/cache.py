"""One model cache for every run directory and working directory: where `model.packaged` models are imported.

    <cache>/models/<name>        <cache> = model.cache_dir, else $GSPO_RAY_CACHE, else ~/.cache/gspo-ray
                                 ($XDG_CACHE_HOME/gspo-ray when that is set)

An import happens once per cache: a lock file next to the model serialises jobs that start together (the second
waits, then finds the model there), and the import is written into a temp directory renamed into place, so a
job that dies mid-import leaves nothing a later job would take for a model.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

CACHE_ENV = "GSPO_RAY_CACHE"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache directory: `cache_dir` (model.cache_dir), else $GSPO_RAY_CACHE, else the user's cache."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "gspo-ray"


def packaged_model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where `model.packaged: <name>` lives once imported."""
    return cache_root(cache_dir) / "models" / name


def atomic_import(out: Path, importer: Callable[[Path], object], is_done: Callable[[Path], bool]) -> Path:
    """`importer(dir)` into a temp directory beside `out`, renamed to `out`, unless `is_done(out)`; concurrent
    callers (threads or processes, any working directory) are serialised by a lock file, so it runs once."""
    out = Path(out).absolute()
    if is_done(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when the process dies
        if is_done(out):  # another job imported it while this one waited
            return out
        tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            importer(tmp)
            if out.exists():  # a partial directory of an interrupted older import
                shutil.rmtree(out)
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
