"""Router churn: the fraction of top-k expert choices one optimizer step changes, per MoE layer.

Real megatron TopKRouter hooks on the tiny Qwen3-MoE (2 layers, 4 experts, top-2): a large step (lr 0.1) moves
routing, lr 0 moves nothing, and under TP=2 with sequence parallelism (each rank routes half of the tokens) the
counts summed over ranks give the 1-process value.
"""
from __future__ import annotations

import pytest
import torch

from _spawn import algo_cfg, make_batch, run_ranks, trainer_cfg
from gspo_ray.trainer.routing.churn import RouterRecorder, compute_router_churn, token_valid_mask

CHURN_KEYS = ("moe/router_churn_l0", "moe/router_churn_l1", "moe/router_churn")


def _on_policy(worker, batch):
    batch.old_logp = worker.compute_logprobs(batch)
    return batch


def _single(rank, world_size, ports, model_dir, batch):
    """lr 0.1 with churn every 2 steps (3 steps), then a fresh worker at lr 0 (1 step)."""
    from gspo_ray.trainer.worker import TrainerWorker

    w = TrainerWorker(rank, world_size, "127.0.0.1", ports[0], model_dir,
                      trainer_cfg(1, lr=0.1, router_churn_every=2), algo_cfg())
    batch = _on_policy(w, batch)
    steps = [w.train_step(batch) for _ in range(3)]
    w.shutdown()
    w0 = TrainerWorker(rank, world_size, "127.0.0.1", ports[1], model_dir, trainer_cfg(1, lr=0.0), algo_cfg())
    before = w0.compute_logprobs(batch)
    still = w0.train_step(batch)
    unchanged = torch.equal(before, w0.compute_logprobs(batch))
    w0.shutdown()
    return {"batch": batch, "steps": steps, "lr0": still, "lr0_unchanged": unchanged}


def _tp2(rank, world_size, ports, model_dir, batch):
    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.optim import mark_parallel_params
    from gspo_ray.trainer.worker import TrainerWorker

    w = TrainerWorker(rank, world_size, "127.0.0.1", ports[0], model_dir, trainer_cfg(2, tp=2, lr=0.1), algo_cfg())
    assert w.gpt.config.sequence_parallel
    out = w.train_step(batch)
    fresh, _ = build_model(model_dir)  # what the worker's DDP wrap had to repair
    out["fixed"] = mark_parallel_params(fresh)
    w.shutdown()
    return out


@pytest.fixture(scope="module")
def runs(tiny_moe_dir):
    single = run_ranks(_single, 1, (str(tiny_moe_dir), make_batch(8, seed=5)), n_ports=2)[0]
    tp2 = run_ranks(_tp2, 2, (str(tiny_moe_dir), single["batch"]))
    return single, tp2


def test_large_step_changes_routing_in_every_layer(runs):
    first = runs[0]["steps"][0]
    for key in CHURN_KEYS:
        assert 0 < first[key] <= 1, key
    assert first["moe/router_churn"] == pytest.approx((first[CHURN_KEYS[0]] + first[CHURN_KEYS[1]]) / 2)


def test_zero_lr_step_changes_no_routing(runs):
    lr0 = runs[0]["lr0"]
    assert runs[0]["lr0_unchanged"]
    for key in CHURN_KEYS:
        assert lr0[key] == 0.0, key


def test_router_churn_every_n_steps(runs):
    steps = runs[0]["steps"]  # versions 0, 1, 2 before each step; measured when version % 2 == 0
    assert CHURN_KEYS[2] in steps[0] and CHURN_KEYS[2] not in steps[1] and CHURN_KEYS[2] in steps[2]


def test_sequence_parallel_shards_sum_to_the_whole(runs):
    single, tp2 = runs
    assert tp2[0][CHURN_KEYS[2]] == tp2[1][CHURN_KEYS[2]]
    # the step itself is the 1-process step: same loss, same global grad norm on both TP ranks
    for r in tp2:
        assert r["train/grad_norm"] == pytest.approx(single["steps"][0]["train/grad_norm"], rel=1e-6)
        assert r["train/loss"] == pytest.approx(single["steps"][0]["train/loss"], rel=1e-5, abs=1e-7)
    for key in CHURN_KEYS:
        # one flipped choice of 2 * ~80 tokens would be ~0.006: the layouts must agree far better
        assert tp2[0][key] == pytest.approx(single["steps"][0][key], abs=1e-9), key


# ---- pure parts ----------------------------------------------------------------------------------------------------
def test_token_valid_mask_is_sequence_major_with_shard_offset():
    lengths = torch.tensor([3, 1])
    # S_local=2, B=2, shard starting at position 2: positions 2,3 -> row 0 valid at s=2 only, row 1 never
    assert token_valid_mask(lengths, 2, 2, 2).tolist() == [True, False, False, False]
    assert token_valid_mask(lengths, 2, 2, 0).tolist() == [True, True, True, False]


def test_counts_compare_top_k_sets_per_token():
    rec = RouterRecorder(torch.nn.Linear(1, 1))  # no routers: fill the captures by hand
    rec.routers = [(0, None), (1, None)]
    # token experts before -> after: layer 0: {0,1}->{0,2} (1 moved), {2,3}->{2,3}; layer 1: {0,1}->{2,3} (2 moved)
    maps = {"before": {0: [torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1]])], 1: [torch.tensor([[1, 1, 0, 0]])]},
            "after": {0: [torch.tensor([[1, 0, 1, 0], [0, 0, 1, 1]])], 1: [torch.tensor([[0, 0, 1, 1]])]}}
    for phase, layers in maps.items():
        for layer, ms in layers.items():
            rec.maps[phase][layer] = [m.bool() for m in ms]
    counts = rec.counts()
    assert counts.tolist() == [[1.0, 4.0], [2.0, 2.0]]
    churn = compute_router_churn([0, 1], counts)
    assert churn == {"moe/router_churn_l0": 0.25, "moe/router_churn_l1": 1.0, "moe/router_churn": 0.625}
    rec.maps["after"][1] = []
    with pytest.raises(RuntimeError, match="layer 1"):
        rec.counts()


def test_tp2_still_needs_the_parallel_param_marks(runs):
    """optim.mark_parallel_params repairs what loaded-weight models lack under TP=2 (without it the grad norm above
    was 1.30 instead of 1.88 and expert grads missed the other TP rank's tokens). When this fails, the model
    builder or megatron-core sets the attributes itself and the repair can go."""
    fixed = runs[1][0]["fixed"]
    assert fixed["tensor_model_parallel"] > 0  # qkv, proj, fc1/fc2 (dense and experts), embedding, output layer
    assert fixed["allreduce"] == 2 * 4 * 2  # layers x experts x (fc1, fc2)
