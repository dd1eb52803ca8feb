"""Routing records (R2 and drift) follow the sequence across DP ranks, on real Megatron routers (tiny Qwen3-MoE,
DP=2 and EP=2).

Rows change DP rank between passes: `split_rows` goes by position and mini-batches are reshuffled. A record kept
only on the rank that first saw a row is missing wherever the row trains next, so R2 there would record the moved
policy's routing instead of replaying the sampling policy's, and drift would count a first sight instead of a
change. Here the sampling forward sees rows 0-3 on rank 0 and 4-7 on rank 1; after an update at lr 0.1 (routing
moves), the rows come back reversed, so every row trains on the rank that did not see it first.
"""
from __future__ import annotations

import pytest

from _spawn import algo_cfg, make_batch, run_ranks, trainer_cfg

DRIFT = "moe/drift_churn"


def _scenario(rank, world_size, ports, model_dir, batch, ep):
    from gspo_ray.trainer.batch_layout import routing_keys
    from gspo_ray.trainer.worker import TrainerWorker

    w = TrainerWorker(rank, world_size, "127.0.0.1", ports[0], model_dir,
                      trainer_cfg(world_size, ep=ep, lr=0.1, routing_replay="R2", micro_batch_size=8),
                      algo_cfg(importance_sampling_level="token"))
    keys = routing_keys(batch)
    batch.old_logp = w.compute_logprobs(batch)  # the sampling policy's forward: both stores record here
    sampled = {k: [t.clone() for t in w.replay.store[k]] for k in keys if k in w.replay.store}
    steps = [w.train_step(batch)]                # same rank as the sampling forward; routing then moves
    reverse = batch.select(list(range(batch.num_sequences))[::-1])
    steps.append(w.train_step(reverse))          # every row on the other rank
    after = {k: [t.clone() for t in w.replay.store[k]] for k in keys if k in w.replay.store}
    w.shutdown()
    return {"sampled": sampled, "after": after, "steps": steps, "keys": keys}


@pytest.mark.parametrize("ep", [1, 2], ids=["dp2", "dp2-ep2"])
def test_records_follow_rows_to_the_rank_that_trains_them(tiny_moe_dir, ep):
    batch = make_batch(8, seed=5)
    ranks = run_ranks(_scenario, 2, (str(tiny_moe_dir), batch, ep))
    keys = ranks[0]["keys"]
    # the sampling forward split the rows 4 + 4; at its end each rank holds both halves' records
    first_sight = ranks[0]["sampled"]
    assert set(first_sight) == set(keys) == set(ranks[1]["sampled"])
    for k in keys:
        assert [t.tolist() for t in ranks[1]["sampled"][k]] == [t.tolist() for t in first_sight[k]], k
    for rank in ranks:
        # R2: after both steps every rank holds every row's record, and it is the sampling forward's (a row
        # first seen on the other rank replayed that record instead of recording the moved policy's routing)
        assert set(rank["after"]) == set(keys)
        for k in keys:
            assert [t.tolist() for t in rank["after"][k]] == [t.tolist() for t in first_sight[k]], k
    first, reversed_step = ranks[0]["steps"]
    assert first[DRIFT] == 0.0  # the sampling policy's weights: nothing moved yet
    # drift compares every reversed row with its first sight on the other rank (a rank that kept only its own
    # records would see 8 first sights here and report nothing)
    assert reversed_step.get(DRIFT, 0.0) > 0.0, reversed_step
    assert reversed_step["moe/router_churn"] == 0.0  # under R2 the replayed forwards route as recorded


def test_r2_is_refused_where_its_first_forward_is_not_the_sampling_policy():
    from gspo_ray.config import ConfigError, load_config

    recipe = "gspo_ray/recipes/tiny_moe.yaml"  # async by default
    with pytest.raises(ConfigError, match="routing_replay 'R2' needs coordinator.mode 'sync'"):
        load_config(recipe, ["trainer.routing_replay=R2"])
    with pytest.raises(ConfigError, match="cannot be combined with rollout.partial"):
        load_config(recipe, ["trainer.routing_replay=R2", "coordinator.mode=sync", "algorithm.eps=fixed",
                             "rollout.max_new_tokens=12", "rollout.partial.segment_tokens=4"])
    ok = load_config(recipe, ["trainer.routing_replay=R2", "coordinator.mode=sync", "algorithm.eps=fixed"])
    assert ok.trainer.routing_replay == "R2"
