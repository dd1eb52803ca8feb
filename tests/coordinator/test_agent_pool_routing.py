"""Agent episodes under partial rollouts live in the rollout worker that ran them: the pool sends a carried group
back to the worker its samples name, and a group whose worker is gone to another one (which starts its episodes
again from their records). Real Ray object refs; the workers are stand-ins called in this process (no engine, no
actor process: an actor's start and torch import cost ~20 s on this machine)."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import ray

from gspo_ray.coordinator.rollout_pool import RolloutPool
from gspo_ray.data.records import Prompt, Sample


class EpisodeWorker:
    """What the pool calls on a rollout worker with rollout.agent and rollout.partial: a round leaves every episode
    open ("aborted"); a continuation finishes it, naming the worker that continued it."""

    def __init__(self, worker_id: int):
        self.worker_id = worker_id

    def ping(self):
        return self.worker_id

    def run_episodes(self, prompts, n, budget=None):
        return [Sample(prompt_uid=p.uid, sample_index=j, prompt_ids=[1], completion_ids=[2], logprobs=[0.0],
                       loss_mask=[1], versions=[0], finish_reason="aborted", worker_id=self.worker_id)
                for p in prompts for j in range(n)]

    def continue_samples(self, samples, budget=None, prompts=None):
        return [dataclasses.replace(s, finish_reason="stop", reward=0.0, worker_id=self.worker_id,
                                    reward_info={"continued_by": float(self.worker_id)}) for s in samples]


class LocalHandle:
    """An actor handle's `.method.remote(...)`, run here, its result put in Ray's object store."""

    def __init__(self, worker):
        self.worker = worker

    def __getattr__(self, name):
        method = getattr(self.worker, name)
        return SimpleNamespace(remote=lambda *args, **kwargs: ray.put(method(*args, **kwargs)))


@pytest.mark.usefixtures("local_ray")
def test_carried_agent_episodes_go_back_to_the_worker_that_holds_them():
    pool = RolloutPool(lambda wid: LocalHandle(EpisodeWorker(wid)), 2, multi_turn=True, call_timeout_s=60)
    prompts = [Prompt(uid=f"p{i}", prompt_ids=[1]) for i in range(6)]
    groups, metrics = pool.wait(pool.submit(prompts, 2, budget=2))  # round 1: every episode left open
    owner = {g.prompt.uid: g.samples[0].worker_id for g in groups}
    assert sorted(set(owner.values())) == [0, 1] and metrics["rollout/unfinished"] == 12
    # the coordinator's carry, in another order than round 1's (a plain split would send p1 to worker 0), the last
    # group from a worker that is gone (a resumed job's records)
    carried = [(g.prompt, g.samples, 2) for g in groups[1:5] + groups[:1]]
    carried.append((groups[5].prompt, [dataclasses.replace(s, worker_id=9) for s in groups[5].samples], None))
    back, metrics = pool.wait(pool.submit([], 2, carried=carried))
    for g in back[:5]:  # continued by the worker that ran them
        assert {s.reward_info["continued_by"] for s in g.samples} == {float(owner[g.prompt.uid])}, g.prompt.uid
    assert {s.reward_info["continued_by"] for s in back[5].samples} <= {0.0, 1.0}  # a live worker took it
    assert all(s.finish_reason == "stop" for g in back for s in g.samples) and metrics["rollout/unfinished"] == 0
