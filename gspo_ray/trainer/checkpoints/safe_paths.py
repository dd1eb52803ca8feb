"""Path checks for checkpoint files on shared volumes (no torch import: the coordinator uses them too).

The checkpoint volume is writable by pods that run user code, so a path read from it (a `latest` pointer, a rank
file) is followed only when it stays inside the checkpoint directory after symlinks are resolved.
"""
from __future__ import annotations

from pathlib import Path

META = "meta.json"  # a trainer checkpoint's completion marker, written last


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that would need unpickling, or that lies outside its checkpoint directory."""


def check_inside(path: str | Path, root: str | Path) -> Path:
    """`path` resolved (symlinks followed) must exist inside `root` resolved, as a regular file or directory.

    Raises UnsafeCheckpointError when it leads outside `root`, FileNotFoundError when it does not exist."""
    real, real_root = Path(path).resolve(), Path(root).resolve()
    if real != real_root and real_root not in real.parents:
        raise UnsafeCheckpointError(f"{path}: resolves to {real}, outside the checkpoint directory {real_root}")
    if not real.exists():
        raise FileNotFoundError(f"{path}: does not exist")
    if not (real.is_file() or real.is_dir()):
        raise UnsafeCheckpointError(f"{path}: not a regular file or directory")
    return real
