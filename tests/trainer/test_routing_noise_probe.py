"""The routing-noise probe (trainer.routing_noise) on real megatron-core routers, tiny Qwen3-MoE (2 layers,
4 experts, top-2): before any update the recorded routing is the routing, so the routing-induced log-ratio is 0;
after large steps (lr 0.1, which moves routing in every layer: test_router_churn) it is not, and the training
itself is the same as without the probe. Moving only the routers' weights gives a routing-induced log-ratio by
itself. Under DP=2 the records follow the rows and the counts add up to the 1-process ones."""
from __future__ import annotations

import pytest

from _spawn import algo_cfg, make_batch, run_ranks, trainer_cfg

NOISE_KEYS = ("moe/routing_logratio_abs_mean", "moe/routing_logratio_std", "moe/routing_logratio_max",
              "moe/grpo_token_clips_removed", "moe/gspo_seq_clips_removed")


def _steps(rank, world_size, ports, model_dir, batch, probe: bool):
    """Old log-probs from the policy (the probe records there), then 3 steps of lr 0.1 on the same batch."""
    from gspo_ray.trainer.worker import TrainerWorker

    # padded rows in both runs: the probe keeps its policy forwards padded (it records per row), and the
    # comparison with the run without it is bit for bit, so the layout must not differ (packed rows equal padded
    # ones to float summation order only: tests/trainer/test_shared_prefix_parity.py)
    w = TrainerWorker(rank, world_size, "127.0.0.1", ports[0], model_dir,
                      trainer_cfg(world_size, lr=0.1, router_churn_every=0, routing_noise=probe,
                                  micro_batch_size=3, packed_rows=False),
                      algo_cfg(importance_sampling_level="token"))
    batch.old_logp = w.compute_logprobs(batch)
    out = [w.train_step(batch) for _ in range(3)]
    w.shutdown()
    return out


def _router_only(rank, world_size, ports, model_dir, batch, scale: float):
    """Old log-probs from the policy (the probe records there), then only the routers' weights move (Gaussian noise
    of `scale` x their std, every other weight as sampled); the next step's probe runs before its update."""
    import torch

    from gspo_ray.trainer.routing.churn import find_routers
    from gspo_ray.trainer.worker import TrainerWorker

    w = TrainerWorker(rank, world_size, "127.0.0.1", ports[0], model_dir,
                      trainer_cfg(world_size, router_churn_every=0, routing_noise=True, micro_batch_size=8),
                      algo_cfg(importance_sampling_level="token"))
    batch.old_logp = w.compute_logprobs(batch)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, router in find_routers(w.gpt):
            router.weight.add_(scale * router.weight.std() * torch.randn(router.weight.shape, generator=g))
    out = w.train_step(batch)
    w.shutdown()
    return out


@pytest.fixture(scope="module")
def runs(tiny_moe_dir):
    batch = make_batch(8, seed=5)
    on = run_ranks(_steps, 1, (str(tiny_moe_dir), batch, True))[0]
    off = run_ranks(_steps, 1, (str(tiny_moe_dir), batch, False))[0]
    dp2 = run_ranks(_steps, 2, (str(tiny_moe_dir), batch, True))
    return on, off, dp2, batch


def test_no_update_no_routing_noise_then_routing_moves_the_log_ratio(runs):
    on, _, _, batch = runs
    tokens = float(batch.loss_mask.sum())
    first, later = on[0], on[1:]
    assert first["moe/routing_noise_tokens"] == tokens and first["moe/routing_noise_seqs"] == 8
    # step 1 runs on the weights that recorded the routing: held = free up to the replayed-softmax rounding
    assert first["moe/routing_logratio_max"] <= 1e-5
    assert first["moe/grpo_token_clips_removed"] == first["moe/gspo_seq_clips_removed"] == 0.0
    for m in later:  # after lr-0.1 steps routing moved: part of log r is routing alone
        assert m["moe/routing_logratio_max"] > 1e-2 and m["moe/routing_logratio_abs_mean"] > 1e-4, m
        assert 0 < m["moe/routing_logratio_share"] <= 10
        for key in NOISE_KEYS:
            assert key in m and m[key] >= 0, key


def test_the_probe_does_not_change_training(runs):
    on, off, _, _ = runs
    for a, b in zip(on, off):
        assert a["train/loss"] == b["train/loss"] and a["train/grad_norm"] == b["train/grad_norm"]
        assert a["train/forward_passes_routing_noise"] >= 1 and "train/forward_passes_routing_noise" not in b
        assert not any(k.startswith("moe/routing_") for k in b)


def test_dp2_records_follow_the_rows_and_counts_add_up(runs):
    on, _, dp2, _ = runs
    for r in dp2:  # every rank reports the mini-batch's metrics
        for step, (m, single) in enumerate(zip(r, on)):
            assert m["moe/routing_noise_tokens"] == single["moe/routing_noise_tokens"], step
            assert m["moe/routing_noise_seqs"] == single["moe/routing_noise_seqs"], step
            for key in NOISE_KEYS:  # after two lr-0.1 steps the DP2 weights differ from 1 process by rounding
                assert m[key] == pytest.approx(single[key], rel=2e-3, abs=1e-6), (step, key)


def test_a_router_only_update_is_routing_noise_alone(tiny_moe_dir):
    """Routers unchanged: held and free routing are one routing, d = 0 exactly. Only the routers moved (noise of
    their own std; no expert, attention or embedding weight changed): the held forward keeps the recorded expert
    choices, the free one takes those the moved routers pick, and d = free - held is > 0. Measured: max 0.035,
    mean |d| 0.008, 95% of the mean |log r| (the rest is the recorded experts' gate weights moving)."""
    batch = make_batch(8, seed=5)
    still = run_ranks(_router_only, 1, (str(tiny_moe_dir), batch, 0.0))[0]
    assert still["moe/routing_logratio_max"] == 0.0 and still["moe/routing_logratio_abs_mean"] == 0.0
    moved = run_ranks(_router_only, 1, (str(tiny_moe_dir), batch, 1.0))[0]
    assert moved["moe/routing_logratio_max"] > 1e-2 and moved["moe/routing_logratio_abs_mean"] > 1e-4, moved
    assert moved["moe/routing_logratio_share"] > 0.5  # most of log r: the experts chosen, not their gates
