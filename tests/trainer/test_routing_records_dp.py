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

R3 in the same processes (DP 2, and DP 2 x EP 2): rows carry routes as the engine returns them (prompt positions
from the prefill, every fed position, the last one none), forwarded first as shared-prefix group rows, then as
padded rows in reverse order (every row on the other DP rank): on every recorded position of every row, in every
micro-batch of every rank, the top-k the trainer's layers used equals the engine's. A group whose rows' routes
differ on a prompt position (as a prefill's rounding could make them) shares only the positions before it.
"""
from __future__ import annotations

import pytest

from _spawn import algo_cfg, make_batch, run_ranks, trainer_cfg

DRIFT = "moe/drift_churn"


def engine_batch(seed: int = 7, vocab: int = 22, experts: int = 4, top_k: int = 2):
    """Prompt groups of 4, 4 and 2 rows (shared prompts; in the first group two completions share their first
    token) with routes as the engine returns them: position q's top-k in each MoE layer is a function of tokens
    0..q (the same history routes the same in every request), the last position (never fed) has none. Row 5's
    routes differ from its group's at prompt position 1 of layer 0, so that group shares one position."""
    import itertools
    import random

    import numpy as np

    from gspo_ray.data.records import Sample, collate, pack_routes

    pairs = list(itertools.combinations(range(experts), top_k))
    rng = random.Random(seed)
    samples, advs = [], []
    for q, size in enumerate((4, 4, 2)):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 7))]
        for j in range(size):
            comp = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 7))]
            if q == 0 and j < 2:
                comp[0] = 3
            ids = prompt + comp
            routes = np.array([[pairs[hash((tuple(ids[:i + 1]), layer, seed)) % len(pairs)] for layer in range(2)]
                               for i in range(len(ids))], dtype=np.int16)
            routes[-1] = -1
            if q == 1 and j == 1:
                routes[1, 0] = [e for e in pairs if list(e) != sorted(routes[1, 0].tolist())][0]
            samples.append(Sample(prompt_uid=f"e{q}", sample_index=j, prompt_ids=prompt, completion_ids=comp,
                                  logprobs=[-1.0] * len(comp), loss_mask=[1] * len(comp), versions=[0] * len(comp),
                                  finish_reason="stop", routes=pack_routes(routes)))
            advs.append([1.0 if j % 2 else -1.0] * len(comp))
    return collate(samples, advs)


def _r3_used_routes(w, batch) -> dict:
    """One train step on `batch`: per training micro-batch of this rank, (recorded positions compared, those
    whose top-k the layers used differs from the engine's, group rows), from the routers' routing maps."""
    import torch

    from gspo_ray.trainer.routing.churn import find_routers
    from gspo_ray.trainer.routing.drift import rows_of_group_layout

    routers = find_routers(w.gpt)
    used, current, out = {}, {}, {"compared": 0, "differ": 0, "group_rows": 0, "prompt": 0}
    hooks = [r.register_forward_hook(lambda m, a, o, i=i: used.__setitem__(i, (a[0].shape, o[1].detach())))
             for i, (_, r) in enumerate(routers)]
    forward = w._logprobs

    def spy(model, mb, purpose, **kw):
        used.clear()
        logp = forward(model, mb, purpose, **kw)
        if purpose == "train":
            current.setdefault("mbs", []).append((mb, dict(used)))
        return logp
    w._logprobs = spy
    try:
        w.train_step(batch)
    finally:
        w._logprobs = forward
        for h in hooks:
            h.remove()
    for mb, layers in current["mbs"]:
        for i, (shape, routing_map) in layers.items():
            s, b = int(shape[0]), int(shape[1])
            idx = routing_map.float().topk(routers[i][1].topk, dim=-1).indices.reshape(s, b, -1)
            if mb.layout is not None:
                idx = rows_of_group_layout(idx, mb.layout)
                out["group_rows"] += int(i == 0) * int(mb.layout.tokens.shape[0])
            for j, row in enumerate(mb.rows):
                if row < 0:
                    continue
                n = int(batch.lengths[row])
                want = batch.routes[row, :n, i].long()
                rec = (want >= 0).all(-1)
                same = (idx[:n, j].sort(-1).values == want.sort(-1).values).all(-1)
                out["compared"] += int(rec.sum())
                out["differ"] += int((rec & ~same).sum())
                out["prompt"] += int(rec[:int((batch.versions[row] < 0).sum() - (batch.tokens.shape[1] - n))].sum())
    return out


def _r3_scenario(rank, world_size, port, model_dir, ep):
    from gspo_ray.trainer.worker import TrainerWorker

    batch = engine_batch()
    w = TrainerWorker(rank, world_size, "127.0.0.1", port, model_dir,
                      trainer_cfg(world_size, ep=ep, lr=0.1, routing_replay="R3", shared_prefix=True,
                                  micro_batch_size=4, router_churn_every=0), algo_cfg())
    out = {"group": _r3_used_routes(w, batch)}
    w.cfg = w.cfg.model_copy(update={"shared_prefix": False})
    out["padded_reversed"] = _r3_used_routes(w, batch.select(list(range(batch.num_sequences))[::-1]))
    w.shutdown()
    return out


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
            "ended": ended, "r3": _r3_scenario(rank, world_size, ports[1], model_dir, ep)}


@pytest.mark.parametrize("ep", [1, 2], ids=["dp2", "dp2-ep2"])
def test_records_follow_rows_to_the_rank_that_trains_them(tiny_moe_dir, ep):
    batch = make_batch(8, seed=5)
    ranks = run_ranks(_scenario, 2, (str(tiny_moe_dir), batch, ep), n_ports=2)
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
    # R3: every recorded position (prompt ones included) routed as the engine did, on group rows and padded rows
    for case in ("group", "padded_reversed"):
        got = [r["r3"][case] for r in ranks]
        assert all(g["differ"] == 0 for g in got), (case, got)
        tokens = int(((engine_batch().routes >= 0).all(-1).all(-1)).sum())  # recorded positions of the batch
        assert sum(g["compared"] for g in got) == 2 * tokens, (case, got)  # each row once, in both MoE layers
        assert all(g["compared"] > 0 and g["prompt"] > 0 for g in got), (case, got)
    assert all(r["r3"]["group"]["group_rows"] > 0 for r in ranks)  # both ranks forwarded group rows


def test_r3_group_rows_share_only_the_prefix_whose_routes_agree():
    from gspo_ray.trainer.group_rows import prefix_groups

    batch = engine_batch()
    plain, matched = prefix_groups(batch), prefix_groups(batch, match_routes=True)
    assert [rows for rows, _ in plain] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert matched[0] == plain[0] and matched[2] == plain[2]  # same history, same routes: the whole prefix shared
    assert plain[1][1] >= 3 and matched[1][1] == 1  # row 5's routes differ at prompt position 1


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
