"""rollout.push_timeout_s against the estimate of one nccl / ipc push, before Ray (preflight/push_bound.py)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from gspo_ray.config import load_config
from gspo_ray.preflight.model import PreflightError
from gspo_ray.preflight.push_bound import check_push_timeout, model_push_bytes

GPUS = ["rollout.num_gpus_per_worker=1", "trainer.num_gpus_per_worker=1"]  # nccl


def test_a_bound_below_one_push_is_refused_naming_the_field(tmp_path):
    save_file({"model.embed_tokens.weight": torch.zeros(64, 32)}, str(tmp_path / "model.safetensors"))
    assert model_push_bytes(tmp_path, "bfloat16") == 64 * 32 * 2
    # 30 s of rendezvous and reload + 4 kB at 6 GB/s: a 10 s bound cannot hold one push
    with pytest.raises(PreflightError, match=r"^rollout.push_timeout_s \(10 s\) is below the estimate of one nccl "
                                             r"push of this model \(30 s"):
        check_push_timeout(load_config(None, GPUS + ["rollout.push_timeout_s=10"]), tmp_path)
    assert check_push_timeout(load_config(None, GPUS), tmp_path) == pytest.approx(30, abs=0.01)
    assert check_push_timeout(load_config(None, ["rollout.push_timeout_s=10"]), tmp_path) is None  # shm: unbounded here
