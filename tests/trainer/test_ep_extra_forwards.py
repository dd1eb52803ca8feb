"""Extra forwards (the routing-noise probe's held forward, R2's recording forward) run on the same micro-batches on
every EP rank: each MoE layer's forward is an all-to-all over the EP group, so a rank that skipped one would pair
its next all-to-all with a peer's different one (a hang until `collective_timeout_s`, or exchanged garbage).

EP 2 (2 ranks), micro_batch_size 1, 3 rows: rank 1's second micro-batch is a fully masked padding row, where the
probe forward used to be skipped. R2: a mini-batch whose micro-batch on rank 0 mixes recorded and new rows (a
recording forward first) while rank 1's rows are all recorded.
"""
from __future__ import annotations

from _spawn import algo_cfg, make_batch, run_ranks, trainer_cfg

TIMEOUT_S = 20  # a desynchronised all-to-all fails after this, not after the default 600 s


def _scenario(rank, world_size, ports, model_dir):
    from gspo_ray.trainer.worker import TrainerWorker

    out = {}
    w = TrainerWorker(rank, world_size, "127.0.0.1", ports[0], model_dir,
                      trainer_cfg(world_size, ep=2, routing_noise=True, micro_batch_size=1, router_churn_every=0,
                                  collective_timeout_s=TIMEOUT_S), algo_cfg())
    batch = make_batch(3, seed=3)
    batch.old_logp = w.compute_logprobs(batch)
    out["noise"] = w.train_step(batch)
    w.shutdown()
    w = TrainerWorker(rank, world_size, "127.0.0.1", ports[1], model_dir,
                      trainer_cfg(world_size, ep=2, routing_replay="R2", micro_batch_size=2, router_churn_every=0,
                                  collective_timeout_s=TIMEOUT_S), algo_cfg())
    seen = make_batch(4, seed=4)
    seen.old_logp = w.compute_logprobs(seen)  # records rows 0, 1 on rank 0 and 2, 3 on rank 1
    fresh = make_batch(4, seed=5)
    fresh.uids = [f"new/{i}" for i in range(4)]
    width = max(seen.tokens.shape[1], fresh.tokens.shape[1])
    mixed = _cat(seen.select([0]), fresh.select([0]), seen.select([2, 3]), width)  # rank 0: [seen, new]
    mixed.old_logp = seen.old_logp.new_zeros(mixed.tokens.shape)
    out["r2"] = w.train_step(mixed)
    w.shutdown()
    return out


def _cat(a, b, c, width):
    import torch

    from gspo_ray.data.records import TrainBatch

    def pad(t):
        return None if t is None else torch.nn.functional.pad(t, (0, width - t.shape[1]))

    parts = (a, b, c)
    fields = {name: torch.cat([pad(getattr(p, name)) for p in parts])
              for name in ("tokens", "loss_mask", "old_logp", "adv")}
    return TrainBatch(**fields, lengths=torch.cat([p.lengths for p in parts]),
                      uids=[u for p in parts for u in p.uids])


def test_ep_ranks_run_the_same_extra_forwards(tiny_moe_dir):
    ranks = run_ranks(_scenario, 2, (str(tiny_moe_dir),), n_ports=2, timeout_s=4 * TIMEOUT_S)
    assert "moe/routing_logratio_abs_mean" in ranks[0]["noise"]
    assert ranks[0]["noise"]["moe/routing_logratio_abs_mean"] == ranks[1]["noise"]["moe/routing_logratio_abs_mean"]
    assert ranks[0]["r2"]["train/loss"] == ranks[1]["r2"]["train/loss"]
    # every rank ran the same forwards: 2 probe forwards each (rank 1's second is the padding row) and R2's
    # recording forward on rank 1 too, whose rows were all recorded already
    assert [r["noise"]["train/forward_passes_routing_noise"] for r in ranks] == [2.0, 2.0]
    assert [r["r2"]["train/forward_passes_routing_record"] for r in ranks] == [1.0, 1.0]
