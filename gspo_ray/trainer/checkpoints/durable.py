"""Files that survive a crash or a power cut, and a manifest that says whether they are intact (no torch import:
the coordinator uses it too).

A rename is atomic but not durable: without fsync of the file and of the directory holding the new name, a crash
can leave a `latest` pointer naming a checkpoint whose files are empty. A truncated or bit-flipped rank file is
caught by the manifest (size and sha256 of every file, written at save) before torch.load meets it.

Nobody reads a checkpoint back to hash it: a trainer rank hashes its file while writing it (`HashingWriter`), the
job's manifest takes those digests (`recorded`) and hashes only the small files it wrote itself, and a check of a
large file on the driver is by size (`hash_max_bytes`); its hash is checked by the rank that loads it
(trainer/checkpoints/checkpoint.py).

    fsync_file(path); fsync_dir(path.parent)
    manifest = build_manifest(ckpt_dir, recorded=digests)   # {"files": {"trainer/rank_0.pt": {"size", "sha256"}}}
    problem = check_manifest(ckpt_dir, manifest, hashes=True)   # None when intact, else one line
"""
from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


def fsync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Make the names in a directory (a rename, a new file) durable. Some filesystems refuse fsync on a directory
    (EINVAL, EBADF): nothing more can be done there, so that is not an error."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def write_durable(path: str | Path, text: str) -> None:
    """Write a small file through a temp name: fsync it, rename it into place, fsync the directory."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class HashingWriter:
    """A binary file object that hashes (sha256) and counts what is written through it (torch.save writes its
    zip sequentially, so the digest is that of the file)."""

    def __init__(self, f):
        self.f, self.size, self._hash = f, 0, hashlib.sha256()

    def write(self, data) -> int:
        self._hash.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def digest(self) -> dict:
        """{"size": bytes written, "sha256": hex digest}, the manifest's record of the file."""
        return {"size": self.size, "sha256": self._hash.hexdigest()}


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def build_manifest(root: str | Path, sync: bool = True, recorded: dict[str, dict] | None = None) -> dict:
    """Size and sha256 of every regular file under `root` (paths relative to it), fsyncing each file and
    directory on the way (`sync`): the files other processes (trainer ranks) wrote are made durable too.
    recorded: {relative path: {"size", "sha256"}} of files hashed as they were written; such a file whose size is
    the recorded one is not read again."""
    recorded = recorded or {}
    root = Path(root)
    files = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if p.is_symlink() or not p.is_file() or name == MANIFEST:
                continue
            if sync:
                fsync_file(p)
            rel, size = p.relative_to(root).as_posix(), p.stat().st_size
            known = recorded.get(rel)
            files[rel] = dict(known) if known and known.get("size") == size else {"size": size, "sha256":
            sha256_file(p)}
        if sync:
            fsync_dir(dirpath)
    return {"version": MANIFEST_VERSION, "files": files}


def check_manifest(root: str | Path, manifest: dict, hashes: bool = True,
                   hash_max_bytes: int | None = None) -> str | None:
    """None when every listed file exists with its recorded size (and, with `hashes`, its sha256: only of the
    files of at most `hash_max_bytes`, when set); else one line naming the first file that differs."""
    root = Path(root)
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return f"{root / MANIFEST}: lists no files"
    for rel, want in files.items():
        p = root / rel
        try:
            size = p.stat().st_size
        except OSError:
            return f"{p}: missing (listed in {MANIFEST})"
        if size != want.get("size"):
            return f"{p}: {size} bytes, {want.get('size')} when saved (truncated or overwritten)"
        small = hash_max_bytes is None or size <= hash_max_bytes
        if hashes and small and sha256_file(p) != want.get("sha256"):
            return f"{p}: content differs from the sha256 recorded when saved"
    return None


def is_disk_full(e: BaseException) -> bool:
    """ENOSPC / EDQUOT anywhere in the chain (a Ray task error carries the remote exception as `cause`)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        e = getattr(e, "cause", None) or e.__cause__
    return False
