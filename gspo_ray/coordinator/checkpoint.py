"""Job checkpoints: `run_dir/checkpoints/step_000050/{trainer/, loop.json}` plus a `latest` pointer.

The pointer is replaced atomically only after both parts are written, so a crash mid-save leaves the previous
checkpoint as the one `--resume` uses. Older checkpoints beyond `keep` are deleted.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from gspo_ray.coordinator.loop import LoopState


class CheckpointManager:
    def __init__(self, run_dir: Path, keep: int = 2):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def save(self, state: LoopState, save_trainer, extra: dict | None = None) -> Path:
        """`save_trainer(dir)` writes the trainer's part (all ranks); then the loop state; then the pointer."""
        path = self.root / f"step_{state.step:06d}"
        if path.exists():
            shutil.rmtree(path)
        (path / "trainer").mkdir(parents=True)
        save_trainer(str(path / "trainer"))
        (path / "loop.json").write_text(json.dumps({"state": dataclasses.asdict(state), **(extra or {})}, indent=1))
        tmp = self.root / "latest.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, self.root / "latest")
        self._prune(keep_name=path.name)
        return path

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / "loop.json").exists() else None

    def load_state(self, path: Path) -> tuple[LoopState, dict]:
        raw = json.loads((Path(path) / "loop.json").read_text())
        return LoopState(**raw.pop("state")), raw

    def _prune(self, keep_name: str) -> None:
        ckpts = sorted(p for p in self.root.glob("step_*") if p.is_dir())
        for p in ckpts[:-self.keep]:
            if p.name != keep_name:
                shutil.rmtree(p, ignore_errors=True)
