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

    w = TrainerWorker(rank, world_size, "127.0.0.1", ports[0], model_dir,
                      trainer_cfg(world_size, lr=0.1, router_churn_every=0, routing_noise=probe,
                                  micro_batch_size=3),
                      algo_cfg(importance_sampling_level="token"))
    batch.old_logp = w.compute_logprobs(batch)
    out = [w.train_step(batch) for _ in range(3)]
    w.shutdown()
    return out


def _router_only(rank, world_size, ports, model_dir, batch, scale: float):
    """Old log-probs from the policy (the probe records there), then only the routers' weights move (Gaussian noise
    of `scale` x their std, every other weight as sampled); the next step's probe runs before its update."""
    import torch

    from gspo_ray.trainer.router_churn import find_routers
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
