"""The process state an in-process engine changes (cores, torch threads, os.environ) comes back whatever the order
in which engines end, and when an engine fails to start."""
from __future__ import annotations

import os

import pytest
import torch

from gspo_ray.rollout.engine_env import hold_process, release_process


def _state() -> tuple:
    return os.sched_getaffinity(0), torch.get_num_threads(), dict(os.environ)


def test_nested_holds_give_the_process_back_after_the_last():
    before = _state()
    hold_process({0})
    os.environ["GSPO_TEST_ENGINE_VAR"] = "first"  # as vLLM sets its variables
    hold_process({0})  # a second in-process engine: its "before" is the first one's binding
    release_process()  # the first one ends first: the second still runs pinned
    assert os.sched_getaffinity(0) == {0} and torch.get_num_threads() == 1
    release_process()
    assert _state() == before
    release_process()  # one release too many does nothing
    assert _state() == before


def test_a_failed_start_gives_the_process_back(monkeypatch, tmp_path):
    import vllm

    from gspo_ray.rollout.engine import RolloutEngine

    def llm(**kwargs):
        os.environ["GSPO_TEST_ENGINE_VAR"] = "set while starting"
        raise RuntimeError("engine start failed")

    monkeypatch.setattr(vllm, "LLM", llm)
    before = _state()
    with pytest.raises(RuntimeError, match="engine start failed"):
        RolloutEngine(tmp_path / "model", run_dir=tmp_path / "run", cpu_cores="0")
    assert _state() == before
