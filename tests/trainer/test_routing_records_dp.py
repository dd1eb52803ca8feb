"""Routing records (R2 and drift) follow the sequence across DP ranks, on real Megatron routers (tiny Qwen3-MoE,
DP=2 and EP=2).

Rows change DP rank between passes: `split_rows` goes by position and mini-batches are reshuffled. A record kept
only on the rank that first saw a row is missing wherever the row trains next, so R2 there would record the moved
policy's routing instead of replaying the sampling policy's, and drift would count a first sight instead of a
change. Here the sampling forward sees rows 0-3 on rank 0 and 4-7 on rank 1; after an update at lr 0.1 (routing
moves), the rows come back reversed, so every row trains on the rank that did not see it first: its record moves
to that rank (only there: no rank holds every record). Stores are bounded by the rollout batch: `end_batch`
(the coordinator's, after a batch's passes) empties them, so over 10 one-step batches a store never holds more than
the current batch.
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
    drift_after = set(w.drift.store.keys())
    w.end_batch()
    ended = w.routing_record_bytes()
    w.shutdown()
    return {"sampled": sampled, "after": after, "steps": steps, "keys": keys, "drift_after": drift_after,
            "ended": ended}


@pytest.mark.parametrize("ep", [1, 2], ids=["dp2", "dp2-ep2"])
def test_records_follow_rows_to_the_rank_that_trains_them(tiny_moe_dir, ep):
    batch = make_batch(8, seed=5)
    ranks = run_ranks(_scenario, 2, (str(tiny_moe_dir), batch, ep))
    keys = ranks[0]["keys"]
    # the sampling forward split the rows 4 + 4: each rank holds the records of its own half, and only those
    assert set(ranks[0]["sampled"]) == set(keys[:4]) and set(ranks[1]["sampled"]) == set(keys[4:])
    first_sight = {**ranks[0]["sampled"], **ranks[1]["sampled"]}
    # R2: after the reversed step each row's record sits on the rank that trained it last, and it is the sampling
    # forward's (a row first seen on the other rank replayed that record instead of recording the moved policy's)
    assert set(ranks[0]["after"]) == set(keys[4:]) and set(ranks[1]["after"]) == set(keys[:4])
    assert ranks[0]["drift_after"] == set(keys[4:]) and ranks[1]["drift_after"] == set(keys[:4])
    for rank in ranks:
        for k, layers in rank["after"].items():
            assert [t.tolist() for t in layers] == [t.tolist() for t in first_sight[k]], k
        assert rank["ended"] == 0  # end_batch: nothing kept past the rollout batch
    first, reversed_step = ranks[0]["steps"]
    assert first[DRIFT] == 0.0  # the sampling policy's weights: nothing moved yet
    # drift compares every reversed row with its first sight on the other rank (a rank that kept only its own
    # records would see 8 first sights here and report nothing)
    assert reversed_step.get(DRIFT, 0.0) > 0.0, reversed_step
    assert reversed_step["moe/router_churn"] == 0.0  # under R2 the replayed forwards route as recorded


def test_r2_and_the_probe_are_refused_where_their_first_forward_is_not_the_sampling_policy():
    from gspo_ray.config import ConfigError, load_config

    recipe = "gspo_ray/recipes/tiny_moe.yaml"  # async by default
    with pytest.raises(ConfigError, match="routing_replay 'R2' needs coordinator.mode 'sync'"):
        load_config(recipe, ["trainer.routing_replay=R2"])
    with pytest.raises(ConfigError, match="cannot be combined with rollout.partial"):
        load_config(recipe, ["trainer.routing_replay=R2", "coordinator.mode=sync", "algorithm.eps=fixed",
                             "rollout.max_new_tokens=12", "rollout.partial.segment_tokens=4"])
    ok = load_config(recipe, ["trainer.routing_replay=R2", "coordinator.mode=sync", "algorithm.eps=fixed"])
    assert ok.trainer.routing_replay == "R2"
    # the routing-noise probe holds R2's records: in async mode it would compare the policy with itself (0)
    with pytest.raises(ConfigError, match="routing_noise needs coordinator.mode 'sync'"):
        load_config(recipe, ["trainer.routing_noise=true"])
    with pytest.raises(ConfigError, match="routing_noise cannot be combined with rollout.partial"):
        load_config(recipe, ["trainer.routing_noise=true", "coordinator.mode=sync", "algorithm.eps=fixed",
                             "rollout.max_new_tokens=12", "rollout.partial.segment_tokens=4"])
    assert load_config(recipe, ["trainer.routing_noise=true", "coordinator.mode=sync", "algorithm.eps=fixed",
                                "coordinator.num_minibatches=2"]).trainer.routing_noise
    assert load_config(recipe).trainer.routing_drift  # drift stays on in async mode: it labels its lag instead


def _ten_batches(rank, world_size, ports, model_dir):
    from gspo_ray.trainer.batch_layout import routing_keys
    from gspo_ray.trainer.worker import TrainerWorker

    w = TrainerWorker(rank, world_size, "127.0.0.1", ports[0], model_dir,
                      trainer_cfg(world_size, routing_noise=True, micro_batch_size=8, router_churn_every=0),
                      algo_cfg())
    held = []
    for i in range(10):  # 10 rollout batches of one optimizer step each (the default 1 pass x 1 mini-batch)
        batch = make_batch(3, seed=100 + i)  # 3 rows over 2 ranks: rank 1's second row is padding (row 0's copy)
        batch.uids = [f"b{i}/{j}" for j in range(3)]
        batch.old_logp = w.compute_logprobs(batch)
        m = w.train_step(batch)
        stores = {"drift": set(w.drift.store.keys()), "noise": set(w.noise.store.keys())}
        held.append({"keys": set(routing_keys(batch)), "stores": stores, "bytes": w.routing_record_bytes(),
                     "drift_tokens": m["moe/drift_tokens"], "tokens": int(batch.lengths.sum())})
        w.end_batch()  # what the coordinator does after the batch's passes
    w.shutdown()
    return held


def test_ten_one_step_batches_leave_only_the_current_batch_and_padding_counts_nothing(tiny_moe_dir):
    ranks = run_ranks(_ten_batches, 2, (str(tiny_moe_dir),))
    sizes = []
    for i in range(10):
        keys = ranks[0][i]["keys"]
        for kind in ("drift", "noise"):
            mine = [r[i]["stores"][kind] for r in ranks]
            assert mine[0] | mine[1] == keys and not mine[0] & mine[1], (i, kind)  # this batch only, each row once
        # drift compared every row's tokens once; the padding copy of row 0 counts nothing (it used to count twice)
        assert ranks[0][i]["drift_tokens"] == ranks[0][i]["tokens"], i
        sizes.append(sum(r[i]["bytes"] for r in ranks))
    assert max(sizes) < 2 * min(sizes)  # O(one batch): no growth over the batches
