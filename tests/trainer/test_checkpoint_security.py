"""Trainer checkpoints are read without unpickling and only from inside their directory (the checkpoint volume is
writable by pods that run user code). The full payload of a real trainer (model, optimizer, scheduler, RNG) loading
with weights_only=True is exercised by test_checkpoint.py, whose resume goes through `load_rank_payload`.
"""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from gspo_ray.trainer.checkpoints import checkpoint as ckpt
from gspo_ray.trainer.checkpoints.safe_paths import UnsafeCheckpointError


class _RunsCodeWhenUnpickled:
    """What a tampered rank file could hold: unpickling it calls open(marker, 'w') (any callable would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _write_checkpoint(d, payload):
    d.mkdir(parents=True, exist_ok=True)
    torch.save(payload, ckpt.rank_file(d, 0))
    (d / ckpt.META).write_text(json.dumps({"world_size": 1}))


def test_rank_file_with_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "code_ran"
    _write_checkpoint(tmp_path / "ckpt", {"model": {"w": torch.ones(2)}, "rng": _RunsCodeWhenUnpickled(marker)})
    with pytest.raises(UnsafeCheckpointError, match="refused to load"):
        ckpt.load_rank_payload(tmp_path / "ckpt", 0)
    assert not marker.exists()  # the payload's code never ran
    # the same file under full unpickling would have run it: the test payload really is hostile
    torch.load(ckpt.rank_file(tmp_path / "ckpt", 0), weights_only=False)
    assert marker.exists()


def test_files_symlinked_out_of_the_checkpoint_are_refused(tmp_path):
    outside = tmp_path / "elsewhere"
    _write_checkpoint(outside, {"model": {"w": torch.ones(2)}})
    d = tmp_path / "ckpt"
    d.mkdir()
    ckpt.rank_file(d, 0).symlink_to(ckpt.rank_file(outside, 0))
    (d / ckpt.META).write_text(json.dumps({"world_size": 1}))
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint directory"):
        ckpt.load_rank_payload(d, 0)
    (d / ckpt.META).unlink()
    (d / ckpt.META).symlink_to(outside / ckpt.META)
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint directory"):
        ckpt.read_meta(d)


def test_plain_payload_loads(tmp_path):
    _write_checkpoint(tmp_path / "ckpt", {"model": {"w": torch.arange(3.0)}, "version": 4, "layout": {"tp": 1},
                                         "scheduler": {"num_steps": 2, "decay_style": "constant", "x": None}})
    payload = ckpt.load_rank_payload(tmp_path / "ckpt", 0)
    assert payload["version"] == 4 and torch.equal(payload["model"]["w"], torch.arange(3.0))


def test_numpy_and_python_rng_states_round_trip_through_weights_only(tmp_path):
    np.random.seed(3)
    random.seed(5)
    np.random.randn(), random.gauss(0, 1)  # a cached gaussian on both sides: part of the state
    path = tmp_path / "rng.pt"
    torch.save({"numpy": ckpt.numpy_rng_to_tensors(np.random.get_state()),
                "python": ckpt.python_rng_to_tensors(random.getstate())}, path)
    expected = (np.random.randn(4).tolist(), [random.gauss(0, 1) for _ in range(4)], random.random())
    loaded = torch.load(path, weights_only=True)
    np.random.set_state(ckpt.numpy_rng_from_tensors(loaded["numpy"]))
    random.setstate(ckpt.python_rng_from_tensors(loaded["python"]))
    assert (np.random.randn(4).tolist(), [random.gauss(0, 1) for _ in range(4)], random.random()) == expected
