"""Env hosts without an engine: envs in child processes keep their state, run outside this process, and a
runaway call is killed with its child (the episodes it hosted fail, the others do not); the thread host runs
the same protocol in-process.
"""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from gspo_ray.data.prompts import load_tokenizer
from gspo_ray.data.records import Prompt
from gspo_ray.envs.multiturn import StepResult
from gspo_ray.models.tiny import make_tiny_model
from gspo_ray.rollout.env_hosts import EnvProcessError, EnvProcessPool, EnvThreadHost, error_name


class CountingEnv:
    """Counts its own steps (state that must survive between calls); "spin" burns CPU forever on step 2."""

    def __init__(self, tokenizer, start: int = 0):
        self.count, self.steps, self.vocab = start, 0, len(tokenizer)

    def reset(self, prompt, seed):
        self.mode = prompt.meta["mode"]
        return [2]

    def step(self, action_ids, action_text):
        self.count += 1
        self.steps += 1
        if self.mode == "spin" and self.steps == 2:
            while True:
                pass
        if self.mode == "raise":
            raise KeyError("no such key")
        return StepResult([3], float(self.count), False, {"pid": float(os.getpid()), "vocab": float(self.vocab)})


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("m") / "model", seed=0))


def _prompt(mode: str) -> Prompt:
    return Prompt(uid=mode, prompt_ids=[2, 5], meta={"mode": mode})


def test_process_pool_keeps_state_and_kills_a_runaway(tok):
    pool = EnvProcessPool(CountingEnv, {"start": 10}, tok, num_procs=2)
    try:
        modes = ["ok", "spin", "ok", "ok"]  # least-loaded placement: episodes 0, 2 -> child 0; 1, 3 -> child 1
        ids = [pool.new_episode_id() for _ in modes]
        resets = [pool.reset(i, _prompt(m), seed=0) for i, m in zip(ids, modes)]
        assert all(c.wait(60) and c.value == [2] for c in resets)
        spin_child = pool.pids[1]
        first = [pool.step(i, [4], "x") for i in ids]
        assert all(c.wait(5) for c in first)
        values = [c.value for c in first]
        assert [v.reward for v in values] == [11.0] * 4, "kwargs reached the env and its state started there"
        assert {v.info["pid"] for v in values} == set(pool.pids) and os.getpid() not in pool.pids
        assert values[0].info["vocab"] == len(tok)
        second = [pool.step(i, [4], "x") for i in ids]
        assert second[0].wait(5) and second[0].value.reward == 12.0, "state survives between calls"
        assert not second[1].wait(0.5), "the spinning step should overrun its timeout"
        pool.abandon(second[1], "spin overran")
        assert isinstance(second[1].error, EnvProcessError) and "spin overran" in str(second[1].error)
        assert _wait_gone(spin_child), "the runaway's process is still running"
        assert second[2].wait(5) and second[2].value.reward == 12.0, "the other child's episodes go on"
        assert second[3].wait(5) and isinstance(second[3].error, EnvProcessError), "its envs are lost with it"
        assert pool.killed == 1
        assert pool.alive(ids[0]) and not pool.alive(ids[1]) and not pool.alive(ids[3])
        # the dead child still hosts episode 3 (fewer envs than the living one): a new env never lands there
        pool.release(ids[1])
        placed = pool.new_episode_id()
        reset = pool.reset(placed, _prompt("ok"), 0)
        assert reset.wait(60) and reset.error is None and pool.alive(placed)
        pool.release(placed)
        for i in ids:
            pool.release(i)
        # the dead child is replaced at the next reset; the pool serves new episodes as before
        again = pool.new_episode_id()
        assert pool.reset(again, _prompt("ok"), 0).wait(60)
        step = pool.step(again, [4], "x")
        assert step.wait(5) and step.value.reward == 11.0 and spin_child not in pool.pids
        os.kill(int(step.value.info["pid"]), signal.SIGKILL)  # killed from outside: seen without any call to it
        deadline = time.monotonic() + 10
        while pool.alive(again) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pool.alive(again), "an env in a killed process still counts as alive"
    finally:
        pool.close()


def _wait_gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_user_errors_come_back_by_name_and_end_only_their_call(tok):
    pool = EnvProcessPool(CountingEnv, {}, tok, num_procs=1)
    try:
        a, b = pool.new_episode_id(), pool.new_episode_id()
        assert pool.reset(a, _prompt("raise"), 0).wait(60) and pool.reset(b, _prompt("ok"), 0).wait(5)
        bad, good = pool.step(a, [4], "x"), pool.step(b, [4], "x")
        assert bad.wait(5) and re.fullmatch(r"KeyError at test_env_hosts\.py:\d+", error_name(bad.error)) and "no such key" in str(bad.error)
        assert good.wait(5) and good.value.reward == 1.0 and pool.killed == 0
        missing = pool.step(999, [4], "x")
        assert missing.wait(1) and isinstance(missing.error, EnvProcessError)
    finally:
        pool.close()


def test_one_process_runs_calls_in_order_and_times_each_from_its_start(tok):
    """num_procs caps the calls running at once; a call queued behind another is not charged its wait."""
    pool = EnvProcessPool(SleepyEnv, {}, tok, num_procs=1)
    try:
        ids = [pool.new_episode_id() for _ in range(3)]
        assert all(pool.reset(i, _prompt("ok"), 0).wait(60) for i in ids)
        calls = [pool.step(i, [4], "x") for i in ids]
        assert all(c.wait(0.6) for c in calls), "each 0.3 s call fits its 0.6 s budget, queued or not"
        starts = sorted(c.started for c in calls)
        assert starts[2] - starts[0] >= 0.55, "the three calls overlapped: the cap did not hold"
    finally:
        pool.close()


class SleepyEnv:
    def __init__(self, tokenizer):
        pass

    def reset(self, prompt, seed):
        return [2]

    def step(self, action_ids, action_text):
        time.sleep(0.3)
        return StepResult([3], 1.0, False)


def test_thread_host_runs_the_same_protocol_in_process(tok):
    host = EnvThreadHost(CountingEnv, {"start": 1}, tok)
    e = host.new_episode_id()
    assert host.reset(e, _prompt("ok"), 0).wait(5)
    step = host.step(e, [4], "x")
    assert step.wait(5) and step.value.reward == 2.0 and step.value.info["pid"] == os.getpid()
    host.release(e)
    gone = host.step(e, [4], "x")
    assert gone.wait(1) and isinstance(gone.error, EnvProcessError)
