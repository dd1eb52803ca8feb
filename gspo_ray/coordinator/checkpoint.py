"""Job checkpoints: `run_dir/checkpoints/step_000050/{trainer/, loop.json}` plus a `latest` pointer.

A save never touches the last good checkpoint: it writes into a fresh `step_N.tmp-<id>` directory, renames it into
place and then switches `latest` atomically; a save that fails midway leaves only a temp directory that the next
save removes. `latest()` falls back to the newest complete checkpoint when the pointer names one that is missing
or incomplete, and refuses a pointer that leaves the checkpoints directory (it lives on a volume that pods
running user code can write). Older checkpoints beyond `keep` are deleted.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path

from gspo_ray.coordinator.loop import LoopState
from gspo_ray.trainer.safe_paths import META, UnsafeCheckpointError, check_inside

log = logging.getLogger(__name__)

# step_000050 (a checkpoint) or step_000050.tmp-1a2b3c4d (one being written, or one `latest` points at for the
# instant an older copy of the same step is swapped out)
NAME = re.compile(r"step_(\d{6,})(\.tmp-[0-9a-f]{8})?")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: a pointer out of the checkpoints directory, or loop and trainer parts
    that disagree."""


class CheckpointManager:
    def __init__(self, run_dir: Path, keep: int = 2):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def save(self, state: LoopState, save_trainer, extra: dict | None = None) -> Path:
        """`save_trainer(dir)` writes the trainer's part (all ranks); then the loop state; then the pointer.

        Everything is written into a temp directory first; the previous checkpoint stays valid until `latest`
        names the new one."""
        final = self.root / f"step_{state.step:06d}"
        tmp = self.root / f"{final.name}.tmp-{uuid.uuid4().hex[:8]}"
        (tmp / "trainer").mkdir(parents=True)
        save_trainer(str(tmp / "trainer"))
        (tmp / "loop.json").write_text(json.dumps({"state": dataclasses.asdict(state), **(extra or {})}, indent=1))
        self._commit(tmp, final)
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
        self._point(final.name)
        if old is not None:
            _remove(old)

    def _point(self, name: str) -> None:
        tmp = self.root / f"latest.tmp-{uuid.uuid4().hex[:8]}"
        tmp.write_text(name)
        os.replace(tmp, self.root / "latest")

    def _pointer_name(self) -> str | None:
        pointer = self.root / "latest"
        return pointer.read_text().strip() if pointer.is_file() else None

    def latest(self) -> Path | None:
        """The checkpoint to resume from: the one `latest` names if complete, else the newest complete one."""
        name = self._pointer_name()
        if name is not None:
            if not NAME.fullmatch(name):
                raise CheckpointError(f"{self.root / 'latest'}: {name!r} is not a checkpoint of this run (expected "
                                      "step_NNNNNN inside this checkpoints directory)")
            path = self.root / name
            if path.exists() and self.is_complete(path):
                return path
        found = self.complete_checkpoints()
        if found and name is not None:
            log.warning("%s names %s, which is missing or incomplete; using %s, the newest complete checkpoint",
                        self.root / "latest", name, found[-1].name)
        return found[-1] if found else None

    def is_complete(self, path: Path) -> bool:
        """Both parts written, and nothing in it leads out of the checkpoints directory."""
        try:
            for part in (path, path / "loop.json", path / "trainer", path / "trainer" / META):
                check_inside(part, self.root)
        except UnsafeCheckpointError as e:
            raise CheckpointError(str(e)) from None
        except OSError:  # a part is missing: a save that did not finish
            return False
        return True

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
        """Keep the newest `keep` complete checkpoints (and the one just written); drop the rest and any leftover
        temp directories of failed saves."""
        complete = self.complete_checkpoints()
        keep = {p.name for p in complete[-self.keep:]} | {keep_name}
        for p in self.root.iterdir():
            if p.name in keep or p.name == "latest":
                continue
            if NAME.fullmatch(p.name) or p.name.startswith((".old-", "latest.tmp-")):
                _remove(p)


def _remove(path: Path) -> None:
    """Delete a checkpoint directory; a symlink is unlinked, never followed."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)
