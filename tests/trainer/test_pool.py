"""TrainerPool: 2 Ray actors (EP=2) form one process group, take a step and export full HF weights."""
from __future__ import annotations

import pytest
import ray
import torch
from safetensors import safe_open

from _spawn import algo_cfg, make_batch, trainer_cfg
from gspo_ray.data.shared_weights import read_shared
from gspo_ray.trainer.pool import TrainerPool


@pytest.fixture(scope="module")
def pool(tiny_moe_dir):
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        p = TrainerPool(tiny_moe_dir, trainer_cfg(2, ep=2, micro_batch_size=2), algo_cfg())
        yield p
        p.shutdown()
    finally:
        ray.shutdown()


def _hf_tensors(model_dir) -> dict[str, torch.Tensor]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_pool_steps_and_exports_hf_weights(pool, tiny_moe_dir, tmp_path):
    hf = _hf_tensors(tiny_moe_dir)
    before = pool.export_weights(bucket_mb=0.05)
    assert before.version == 0 and len(before.buckets) > 1  # 50 kB buckets: the export really is bucketed
    exported = {n: t for bucket in before.buckets for n, t in bucket}
    assert {n: tuple(t.shape) for n, t in exported.items()} == {n: tuple(t.shape) for n, t in hf.items()}
    assert all(torch.equal(exported[n], hf[n]) for n in hf)  # untouched weights round-trip exactly
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in exported.values())

    batch = make_batch(8)
    batch.old_logp = pool.compute_logprobs(batch)
    metrics = pool.train_step(batch)
    assert metrics["train/policy_version"] == 1.0 and pool.version() == 1
    assert metrics["train/n_seqs"] == 8 and metrics["train/grad_norm"] > 0
    assert "moe/router_churn" in metrics

    after = pool.export_weights()
    assert after.version == 1
    moved = {n for bucket in after.buckets for n, t in bucket if not torch.equal(t, hf[n])}
    # every expert of both EP ranks is exported and trained (experts 2, 3 live on rank 1)
    assert {f"model.layers.0.mlp.experts.{e}.up_proj.weight" for e in range(4)} <= moved
    assert "model.layers.1.mlp.gate.weight" in moved
    # the same export as object refs (what the coordinator pushes): one ref per bucket, same tensors
    refs = pool.export_weights(as_refs=True)
    assert refs.version == 1 and all(isinstance(r, ray.ObjectRef) for r in refs.buckets)
    fetched = {n: t for r in refs.buckets for n, t in ray.get(r)}
    assert fetched.keys() == hf.keys()
    assert all(torch.equal(fetched[n], t) for bucket in after.buckets for n, t in bucket)
    # ... and through rank 0's shared-memory file (the push on one node): a small record, the same bits
    shared = pool.export_weights(shared=True, as_refs=True)
    assert shared.version == 1 and not shared.buckets and shared.shared.fallback
    # R9: the coordinator finds rank 0's node from the pool's placement group, the node its file says it is on
    from gspo_ray.coordinator.loop import placement_node

    assert placement_node(pool.pg, 0) == shared.shared.node_id == ray.get_runtime_context().get_node_id()
    mapped = dict(read_shared(shared.shared))
    assert mapped.keys() == hf.keys()
    assert all(torch.equal(mapped[n], t) for bucket in after.buckets for n, t in bucket)
    assert {n for r in shared.shared.fallback for n, _ in ray.get(r)} == hf.keys()  # for engines on other nodes

    # save / load through the pool: the restored policy scores the batch exactly as before
    logp = pool.compute_logprobs(batch)
    pool.save(tmp_path / "ckpt")
    pool.train_step(batch)
    assert pool.load(tmp_path / "ckpt") == 1
    assert torch.equal(pool.compute_logprobs(batch), logp)
