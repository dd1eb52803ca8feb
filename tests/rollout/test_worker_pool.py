"""Two RolloutWorker Ray actors on one machine, each pinned to its own core, serve one batch together: every group
comes back scored and tagged with its worker; weights pushed as Ray object refs reach both; a pause reaches a
running `generate` and the aborted samples are finished later by `continue_samples`; an async scale-down lets the
batch in flight finish (last: it stops worker 1).
"""
from __future__ import annotations

import shutil

import pytest
import torch

from gspo_ray.config import RewardConfig, RolloutConfig
from gspo_ray.data.prompts import PromptSource
from gspo_ray.models.tiny import make_tiny_model
from gspo_ray.rollout.weight_sync import (WeightProbe, hf_teacher_forced_logprobs, iter_buckets,
                                          read_checkpoint_weights)
from gspo_ray.rollout.worker import RolloutWorker

ray = pytest.importorskip("ray")
GROUP = 4


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    model = make_tiny_model("qwen3_moe", root / "model", seed=4, hidden=128)
    cfg = RolloutConfig(num_workers=2, group_size=GROUP, max_new_tokens=24, max_model_len=64)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        Worker = ray.remote(num_cpus=1, max_concurrency=2)(RolloutWorker)
        workers = [Worker.remote(i, str(model), cfg, run_dir=str(root / "run"),
                                 reward_runner=RewardConfig(fn="gspo_ray.envs.rewards:copy_reward"))
                   for i in range(2)]
        assert ray.get([w.ping.remote() for w in workers], timeout=300) == [0, 1]
        # each engine pinned to its own core, in its own process
        info = ray.get([w.describe.remote() for w in workers])
        assert [i["cpu_affinity"] for i in info] == [[0], [1]] and info[0]["pid"] != info[1]["pid"]
        prompts = PromptSource.from_task("copy", model, num_train=200, seed=0).take(64)
        yield workers, prompts, model
        for w in workers:  # the scale-down test stops worker 1
            try:
                ray.get(w.shutdown.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                pass
    finally:
        ray.shutdown()


def test_two_workers_serve_one_batch(pool):
    workers, prompts, _ = pool
    batch = prompts[:8]
    shards = [batch[i::2] for i in range(2)]  # round-robin split
    results = ray.get([w.generate.remote(shard) for w, shard in zip(workers, shards)], timeout=300)
    by_uid = {}
    for worker_id, samples in enumerate(results):
        assert {s.worker_id for s in samples} == {worker_id}
        for s in samples:
            by_uid.setdefault(s.prompt_uid, []).append(s)
    assert set(by_uid) == {p.uid for p in batch}
    for p in batch:
        group = by_uid[p.uid]
        assert sorted(s.sample_index for s in group) == list(range(GROUP))
        assert all(s.prompt_ids == p.prompt_ids and s.versions == [0] * s.num_tokens for s in group)
        # copy_reward: 0..2, scored off the engine's critical path but before generate returned
        assert all(s.failed is None and 0.0 <= s.reward <= 2.0 for s in group)
    metrics = ray.get(workers[0].last_metrics.remote())
    assert metrics["rollout/samples"] == 4 * GROUP and metrics["rollout/tokens_per_s"] > 0
    assert metrics["reward/num_failed"] == 0


def test_push_object_refs_to_both_workers(pool, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    workers, prompts, model = pool
    gen = torch.Generator().manual_seed(1)
    moved = {n: t + 0.02 * torch.randn(t.shape, generator=gen) for n, t in read_checkpoint_weights(model)}
    shutil.copytree(model, tmp_path / "moved")
    save_file(moved, str(tmp_path / "moved" / "model.safetensors"), metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "moved", dtype=torch.float32).eval()
    probe_ids = list(prompts[0].prompt_ids) + [3, 4, 5, 6, 7, 8]
    probe = WeightProbe.single(probe_ids, hf_teacher_forced_logprobs(hf, [probe_ids])[0])
    refs = [ray.put(b) for b in iter_buckets(moved.items(), bucket_mb=0.25)]  # fetched one by one by each worker
    metrics = ray.get([w.update_weights.remote(5, refs, probe) for w in workers], timeout=120)
    for m in metrics:
        assert m["sync/num_buckets"] == len(refs) and m["sync/verify_max_abs_diff"] <= 1e-4
    assert ray.get([w.current_version.remote() for w in workers]) == [5, 5]
    samples = ray.get(workers[1].generate.remote(prompts[:2]))
    assert {v for s in samples for v in s.versions} == {5}


def test_engine_nodes_are_asked_of_the_actors(pool):
    """R9: the coordinator learns each engine's node from the actor itself (through Ray's __ray_call__)."""
    from gspo_ray.coordinator.loop import actor_node_ids, export_plan

    workers, _, _ = pool
    here = ray.get_runtime_context().get_node_id()
    nodes = actor_node_ids(workers)
    assert nodes == [here, here]
    assert export_plan(True, here, nodes) == (True, False)  # one node: the file, no object-store copy
    assert export_plan(True, "another-node", nodes) == (False, True)


def test_pause_reaches_running_generate_and_continue_finishes(pool):
    workers, prompts, _ = pool
    w = workers[0]
    running = w.generate.remote(prompts, version=7)  # 64 prompts x 4: long enough to be caught in flight
    ray.get(w.pause.remote())  # served by the actor's 2nd thread while generate runs
    samples = ray.get(running, timeout=300)
    aborted = [s for s in samples if s.finish_reason == "aborted"]
    assert aborted, "pause did not reach the running generate"
    assert all(s.reward is None for s in aborted)  # unfinished samples are not scored yet
    while_paused = ray.get(w.generate.remote(prompts[:1]))
    assert [s.finish_reason for s in while_paused] == ["aborted"] * GROUP
    assert all(s.num_tokens == 0 for s in while_paused)
    ray.get(w.resume.remote())
    done = ray.get(w.continue_samples.remote(samples, version=8), timeout=300)
    assert [(s.prompt_uid, s.sample_index) for s in done] == [(s.prompt_uid, s.sample_index) for s in samples]
    assert all(s.finish_reason in ("stop", "length") for s in done)
    for before, after in zip(samples, done):
        k = before.num_tokens
        assert after.completion_ids[:k] == before.completion_ids and after.logprobs[:k] == before.logprobs
        assert after.versions == [7] * k + [8] * (after.num_tokens - k)
        assert after.reward is not None  # finished by the continuation, then scored


def test_default_cores_split_the_machine_between_workers():
    from gspo_ray.rollout.engine import parse_cores
    from gspo_ray.rollout.worker import default_cpu_cores

    two = RolloutConfig(num_workers=2)
    assert [default_cpu_cores(i, two, cpu_count=2) for i in range(2)] == ["0", "1"]
    assert default_cpu_cores(0, RolloutConfig(num_workers=1), cpu_count=2) is None  # a lone worker keeps all
    wide = RolloutConfig(num_workers=2, num_cpus_per_worker=2)
    assert [default_cpu_cores(i, wide, cpu_count=8) for i in range(2)] == ["0,1", "2,3"]
    assert parse_cores("0-2,5") == {0, 1, 2, 5}


def test_async_scale_down_lets_the_batch_in_flight_finish(pool):
    """A worker removed while a dispatched batch is in flight (async mode: the next batch samples while this one
    trains) finishes its part of that batch: no "aborted" completions, nothing counted failed; then it stops.
    Runs last in this module: it stops worker 1."""
    from gspo_ray.coordinator.buffer import GroupBuffer
    from gspo_ray.coordinator.rollout_pool import RolloutPool

    workers, prompts, _ = pool
    rollout = RolloutPool(lambda wid: workers[wid], 2)
    pending = rollout.submit(prompts[:32], GROUP)      # the async batch in flight at a step boundary ...
    assert rollout.scale(1) == {"rollout/workers": 1}  # ... when `gspo-ray scale rollout 1` is applied
    assert rollout.num_workers == 1 and list(rollout.retiring) == [1]
    groups, metrics = rollout.wait(pending)
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 32 * GROUP and metrics["rollout/unfinished"] == 0
    assert {s.worker_id for s in samples} == {0, 1}    # worker 1 served its half to the end
    assert all(s.finish_reason in ("stop", "length") and s.reward is not None for s in samples)
    stats = GroupBuffer(filter_zero_adv=False).admit(groups, current_version=0)
    assert stats.failed_samples == 0 and stats.admitted == 32
    assert rollout.retiring == {}                      # stopped once its calls were back
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(workers[1].ping.remote(), timeout=60)

