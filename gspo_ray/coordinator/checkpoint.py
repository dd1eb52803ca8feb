"""Job checkpoints: `run_dir/checkpoints/step_000050/{trainer/, loop.json}` plus a `latest` pointer.

A save never touches the last good checkpoint: it writes into a fresh `step_N.tmp-<id>` directory, records the
size and sha256 of every file in its `manifest.json`, fsyncs files and directories, renames it into place and then
switches `latest` atomically (and durably). The rank files' digests come from the ranks, which hashed them while
writing (trainer/meta.json `files`): the driver never reads a rank file back. Verifying a checkpoint here hashes
the files of at most `hash_max_bytes` (loop state, meta.json) and checks the larger ones by size; their sha256 is
checked by the trainer rank that loads them (a mismatch there is a CorruptCheckpointError naming the file). A save that fails midway removes its temp directory; a full disk is a
one-line CheckpointDiskFull. `latest()` returns the newest *verified* checkpoint (every file matching its
manifest): when the pointer's checkpoint is missing, incomplete or broken (a truncated rank file), it warns naming
it and falls back to the newest one that verifies. A pointer that leaves the checkpoints directory is refused (it
lives on a volume that pods running user code can write). Older checkpoints beyond `keep` (the newest `keep`
complete ones stay; None keeps all) are deleted after each save; a checkpoint found broken does not count among
them, so the one `latest()` falls back to is never the one deleted.
Checkpoints written before manifests existed are accepted on their completion markers alone.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path

from gspo_ray.coordinator.loop import LoopState
from gspo_ray.trainer.checkpoints.durable import (MANIFEST, build_manifest, check_manifest, fsync_dir,
                                                  is_disk_full, write_durable)
from gspo_ray.trainer.checkpoints.safe_paths import META, UnsafeCheckpointError, check_inside

log = logging.getLogger(__name__)

# step_000050 (a checkpoint) or step_000050.tmp-1a2b3c4d (one being written, or one `latest` points at for the
# instant an older copy of the same step is swapped out)
NAME = re.compile(r"step_(\d{6,})(\.tmp-[0-9a-f]{8})?")
HASH_MAX_BYTES = 1 << 20  # files up to this size are hashed when a checkpoint is verified here; larger: by size


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: a pointer out of the checkpoints directory, or loop and trainer parts
    that disagree."""


class CheckpointDiskFull(OSError):
    """A save ran out of disk space (ENOSPC / quota); its partial files are removed, the last checkpoint stays."""


class CheckpointManager:
    def __init__(self, run_dir: Path, keep: int | None = 2, hash_max_bytes: int | None = HASH_MAX_BYTES):
        self.root = Path(run_dir) / "checkpoints"
        self.keep, self.hash_max_bytes = keep, hash_max_bytes
        self._verified: set[str] = set()  # names hashed once in this process (written here, or checked)
        self._broken: set[str] = set()  # names `latest()` skipped: they never count among the kept

    def save(self, state: LoopState, save_trainer, extra: dict | None = None) -> Path:
        """`save_trainer(dir)` writes the trainer's part (all ranks); then the loop state; then the pointer.

        Everything is written into a temp directory first; the previous checkpoint stays valid until `latest`
        names the new one."""
        final = self.root / f"step_{state.step:06d}"
        tmp = self.root / f"{final.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            (tmp / "trainer").mkdir(parents=True)
            save_trainer(str(tmp / "trainer"))
            write_durable(tmp / "loop.json", json.dumps({"state": dataclasses.asdict(state), **(extra or {})},
                                                        indent=1))
            # sizes + hashes of what is on disk now (fsyncing the trainer ranks' files too), the last file written
            write_durable(tmp / MANIFEST, json.dumps(build_manifest(tmp, recorded=_recorded(tmp)), indent=1))
            fsync_dir(self.root)
        except BaseException as e:  # a failed save leaves nothing behind (and never the last good checkpoint)
            _remove(tmp)
            if is_disk_full(e):
                raise CheckpointDiskFull(errno.ENOSPC, f"No space left on device while saving {final.name} under "
                                         f"{self.root}: free space and --resume (the last checkpoint, "
                                         f"{self._pointer_name() or 'none'}, is intact)") from None
            raise
        self._commit(tmp, final)
        self._verified.add(final.name)
        self._broken.discard(final.name)  # written again: good now
        self._prune(keep_name=final.name)
        return final

    def _commit(self, tmp: Path, final: Path) -> None:
        """Move a complete checkpoint into place; at every instant `latest` names a complete checkpoint (or, for a
        moment, a name that `latest()` resolves by falling back to the newest complete one)."""
        old = None
        if final.exists() or final.is_symlink():
            if self._pointer_name() == final.name:
                self._point(tmp.name)  # the pointer never names a directory while it is moved away
            old = self.root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(self.root)
        self._point(final.name)
        if old is not None:
            _remove(old)

    def _point(self, name: str) -> None:
        tmp = self.root / f"latest.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as f:
            f.write(name)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / "latest")
        fsync_dir(self.root)  # the pointer's new target survives a crash

    def _pointer_name(self) -> str | None:
        pointer = self.root / "latest"
        return pointer.read_text().strip() if pointer.is_file() else None

    def latest(self) -> Path | None:
        """The checkpoint to resume from: the one `latest` names if it verifies, else the newest that does (with
        a warning naming each one skipped and why)."""
        name = self._pointer_name()
        candidates = []
        if name is not None:
            if not NAME.fullmatch(name):
                raise CheckpointError(f"{self.root / 'latest'}: {name!r} is not a checkpoint of this run (expected "
                                      "step_NNNNNN inside this checkpoints directory)")
            path = self.root / name
            if path.exists() or path.is_symlink():
                candidates.append(path)
            else:
                log.warning("%s names %s, which is missing", self.root / "latest", name)
        candidates += [p for p in reversed(self.complete_checkpoints()) if p not in candidates]
        for path in candidates:
            problem = self.verify(path)
            if problem is None:
                if name is not None and path.name != name:
                    log.warning("%s names %s; resuming from %s, the newest checkpoint that verifies",
                                self.root / "latest", name, path.name)
                return path
            log.warning("checkpoint %s is broken or incomplete, skipping it: %s", path, problem)
            self._broken.add(path.name)
        return None

    def resume_point(self) -> Path | None:
        """What `--resume` will most likely take, cheaply (sizes, no hashes; `latest()` verifies): the checkpoint
        `latest` names when it is complete, else the newest complete one. For the line a stopped job prints."""
        name = self._pointer_name()
        if name is not None and NAME.fullmatch(name) and self.is_complete(self.root / name):
            return self.root / name
        done = self.complete_checkpoints() if self.root.is_dir() else []
        return done[-1] if done else None

    def verify(self, path: Path) -> str | None:
        """None when the checkpoint is complete and every file matches its manifest (size and sha256), else the
        problem in one line. Raises CheckpointError when a part leads out of the checkpoints directory."""
        if not self.is_complete(path, check_sizes=False):
            return "incomplete (a part is missing: its save did not finish)"
        if path.name in self._verified:
            return self._manifest_problem(path, hashes=False)
        problem = self._manifest_problem(path, hashes=True)
        if problem is None:
            self._verified.add(path.name)
        return problem

    def _manifest_problem(self, path: Path, hashes: bool) -> str | None:
        manifest_path = path / MANIFEST
        if not manifest_path.exists():
            return None  # written before manifests: its completion markers are all there is to check
        try:
            check_inside(manifest_path, self.root)
            manifest = json.loads(manifest_path.read_text())
            for rel in manifest.get("files", {}):
                check_inside(path / rel, self.root)
        except UnsafeCheckpointError as e:
            raise CheckpointError(str(e)) from None
        except (OSError, ValueError, AttributeError) as e:
            return f"{manifest_path}: unreadable ({e})"
        return check_manifest(path, manifest, hashes=hashes, hash_max_bytes=self.hash_max_bytes)

    def is_complete(self, path: Path, check_sizes: bool = True) -> bool:
        """Both parts written, every file at its recorded size (cheap: no hashing), and nothing in it leads out of
        the checkpoints directory."""
        try:
            for part in (path, path / "loop.json", path / "trainer", path / "trainer" / META):
                check_inside(part, self.root)
        except UnsafeCheckpointError as e:
            raise CheckpointError(str(e)) from None
        except OSError:  # a part is missing: a save that did not finish
            return False
        return not check_sizes or self._manifest_problem(path, hashes=False) is None

    def complete_checkpoints(self) -> list[Path]:
        """Complete `step_N` checkpoints, oldest first; a symlinked or escaping entry is skipped with a warning."""
        out = []
        for p in self.root.glob("step_*"):
            m = NAME.fullmatch(p.name)
            if not m or m.group(2):
                continue
            try:
                if self.is_complete(p):
                    out.append((int(m.group(1)), p))
            except CheckpointError as e:
                log.warning("ignoring %s: %s", p, e)
        return [p for _, p in sorted(out)]

    def load_state(self, path: Path) -> tuple[LoopState, dict]:
        raw = json.loads((Path(path) / "loop.json").read_text())
        return LoopState(**raw.pop("state")), raw

    def _prune(self, keep_name: str) -> None:
        """Keep the newest `keep` complete checkpoints not known broken (and the one just written); drop the rest
        and any leftover temp directories of failed saves. keep None: only the temp directories go."""
        complete = [p for p in self.complete_checkpoints() if p.name not in self._broken]
        keep = {p.name for p in (complete if self.keep is None else complete[-self.keep:])} | {keep_name}
        for p in self.root.iterdir():
            if p.name in keep or p.name == "latest":
                continue
            if NAME.fullmatch(p.name) or p.name.startswith((".old-", "latest.tmp-")):
                _remove(p)


def _recorded(ckpt: Path) -> dict[str, dict]:
    """The digests the trainer ranks took of their files while writing them (trainer/meta.json `files`), keyed by
    their path in the checkpoint; {} when there are none."""
    meta = ckpt / "trainer" / META
    try:
        files = json.loads(meta.read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return {f"trainer/{name}": d for name, d in files.items() if isinstance(d, dict) and "/" not in name}


def _remove(path: Path) -> None:
    """Delete a checkpoint directory; a symlink is unlinked, never followed."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def checkpoint_bytes(path: Path) -> int:
    """Bytes a checkpoint takes on disk (every file in it)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and not p.is_symlink())
