"""Routing Replay (R2) on real megatron TopKRouters, tiny Qwen3-MoE (2 layers, 4 experts, top-2).

With replay the forwards after the first route exactly as recorded (router churn exactly 0, also on a micro-batch
mixing recorded and new rows) while the router still learns (its weights move: Adam's first step moves a weight
only where the gradient is non-zero); without replay the same large step changes routing (churn > 0).
Routing drift (sampling policy -> policy being updated) is 0 before the first update, and after it shows the
unreplayed routing moving even under R2; its top-k is the routing the layers really use when nothing replays.
"""
from __future__ import annotations

import pytest
import torch

from _spawn import algo_cfg, make_batch, run_ranks, trainer_cfg
from gspo_ray.trainer.routing.churn import find_routers

CHURN = "moe/router_churn"


def _router_weights(worker):
    return [r.weight.detach().clone() for _, r in find_routers(worker.gpt)]


def _run(worker, batch, mixed):
    batch.old_logp = worker.compute_logprobs(batch)  # the sampling policy's forward: R2 and drift record here
    drift_store = {u: [t.clone() for t in ts] for u, ts in worker.drift.store.items()}
    w0 = _router_weights(worker)
    steps = [worker.train_step(batch) for _ in range(2)]  # records on the first, replays on the second
    moved = [float((a - b).abs().max()) for a, b in zip(w0, _router_weights(worker))]
    mixed.old_logp = worker.compute_logprobs(mixed)
    steps.append(worker.train_step(mixed))  # half recorded rows, half new: a recording forward runs first
    stored = {u: [t.clone() for t in ts] for u, ts in worker.replay.store.items()} if worker.replay else {}
    worker.shutdown()
    return {"steps": steps, "router_moved": moved, "stored": stored, "drift_store": drift_store}


def _scenario(rank, world_size, ports, model_dir, batch, mixed):
    from gspo_ray.trainer.worker import TrainerWorker

    out = {}
    for i, mode in enumerate(("R2", "none")):
        w = TrainerWorker(rank, world_size, "127.0.0.1", ports[i], model_dir,
                          trainer_cfg(1, lr=0.1, routing_replay=mode), algo_cfg(importance_sampling_level="token"))
        out[mode] = _run(w, batch, mixed)
    return out


@pytest.fixture(scope="module")
def runs(tiny_moe_dir):
    batch = make_batch(8, seed=5)
    fresh = make_batch(8, seed=6)
    mixed = batch.select([0, 1, 2, 3])
    extra = fresh.select([0, 1, 2, 3])
    extra.uids = [f"new/{i}" for i in range(4)]
    from gspo_ray.data.records import TrainBatch

    width = max(mixed.tokens.shape[1], extra.tokens.shape[1])

    def pad(t):
        return torch.nn.functional.pad(t, (0, width - t.shape[1]))
    both = TrainBatch(tokens=torch.cat([pad(mixed.tokens), pad(extra.tokens)]),
                      loss_mask=torch.cat([pad(mixed.loss_mask), pad(extra.loss_mask)]),
                      old_logp=torch.zeros(8, width), adv=torch.cat([pad(mixed.adv), pad(extra.adv)]),
                      lengths=torch.cat([mixed.lengths, extra.lengths]), uids=mixed.uids + extra.uids)
    # interleaved, so each micro-batch of 4 rows holds 2 recorded and 2 new rows
    return run_ranks(_scenario, 1, (str(tiny_moe_dir), batch, both.select([0, 4, 1, 5, 2, 6, 3, 7])), n_ports=2)[0]


def test_replayed_forwards_route_exactly_as_recorded(runs):
    steps = runs["R2"]["steps"]
    for s in steps:
        assert s[CHURN] == 0.0 and s["moe/router_churn_l0"] == 0.0 and s["moe/router_churn_l1"] == 0.0
    # the third step's 2 micro-batches each mix recorded and new rows: one extra no-grad recording forward each
    assert steps[2]["train/forward_passes_routing_record"] == 2.0
    assert "train/forward_passes_routing_record" not in steps[0]
    stored = runs["R2"]["stored"]
    assert len(stored) == 12 and all(len(layers) == 2 for layers in stored.values())
    assert all(t.shape[1] == 2 and int(t.min()) >= 0 and int(t.max()) < 4 for ts in stored.values() for t in ts)


def test_router_still_learns_under_replay(runs):
    assert all(m > 1e-3 for m in runs["R2"]["router_moved"]), runs["R2"]["router_moved"]


def test_without_replay_the_same_steps_change_routing(runs):
    steps = runs["none"]["steps"]
    assert steps[0][CHURN] > 0 and steps[1][CHURN] > 0
    assert runs["none"]["stored"] == {}


DRIFT = "moe/drift_churn"


def test_drift_top_k_is_the_routing_the_layers_use(runs):
    """Both workers start from the same weights: what drift computed from the router inputs (replay off) equals
    what R2 recorded from the routers' own top-k on the same sampling forward."""
    natural, used = runs["none"]["drift_store"], runs["R2"]["stored"]
    assert set(natural) >= set(runs["R2"]["drift_store"]) and len(natural) == 8
    for uid, layers in natural.items():
        assert [t.tolist() for t in layers] == [t.sort(dim=-1).values.tolist() for t in used[uid]], uid


@pytest.mark.parametrize("mode", ["R2", "none"])
def test_drift_is_zero_before_the_first_update_and_moves_after(runs, mode):
    first, second = runs[mode]["steps"][:2]
    assert first[DRIFT] == 0.0 and first["moe/drift_churn_l0"] == 0.0  # same weights as the sampling forward
    assert second[DRIFT] > 0.0, second  # lr 0.1 moved the routers: under R2 too, though the layers replay
    # the mixed batch's recorded rows compare against their first sight two updates ago: still moved (its new rows,
    # first seen by the sampling forward just before, add 0)
    assert runs[mode]["steps"][2][DRIFT] > 0.0
