"""Megatron (the trainer's model and log-prob code) on a spawned process, for rollout tests that compare the
engine with the trainer. Megatron and its CPU patches never enter the pytest process."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

_TRAINER_TESTS = Path(__file__).resolve().parents[1] / "trainer"
for _root in (_TRAINER_TESTS, Path(__file__).resolve().parent):  # `_spawn`, and this module for the children
    if str(_root) not in sys.path:
        sys.path.append(str(_root))

from _spawn import run_ranks  # noqa: E402


def _scenario(rank, world_size, ports, model_dir, sequences, temperature):
    from gspo_ray.trainer.logprobs import forward_logprobs
    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed

    init_distributed(0, 1, "127.0.0.1", ports[0])
    model, _ = build_model(model_dir)
    model.eval()
    with torch.no_grad():
        out = [forward_logprobs(model, torch.tensor([ids]), temperature=temperature)[0, 1:].tolist()
               for ids in sequences]
    destroy_distributed()
    return out


def megatron_logprobs(model_dir, sequences: list[list[int]], temperature: float) -> list[list[float]]:
    """Teacher-forced log-probs of each sequence's tokens after the first, at `temperature`, by the trainer."""
    return run_ranks(_scenario, 1, (str(model_dir), sequences, temperature))[0]
