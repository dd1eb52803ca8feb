"""The trainer side of tests/rollout/test_engine_routes.py on a spawned rank (importable by name, so the spawned
process can load the scenario): train steps with R3 and without replay, the routing each layer really used, and the
routing-agreement metrics."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1] / "trainer"))  # `_spawn`

from _spawn import algo_cfg, run_ranks, trainer_cfg  # noqa: E402

TOP_K = 2


def _used_routes(worker, batch, step):
    """(metrics, the routing the layers used [B, S, layers, k]) of one train step (routing_map -> expert ids): the
    forward in padded rows (packed_rows off), so the routing map reshapes to [S, B]."""
    from gspo_ray.trainer.routing.churn import find_routers

    used = {}
    hooks = [r.register_forward_hook(lambda m, a, o, i=i: used.__setitem__(i, o[1].detach().clone()))
             for i, (_, r) in enumerate(find_routers(worker.gpt))]
    m = step(batch)
    for h in hooks:
        h.remove()
    S, B = batch.tokens.shape[1], batch.tokens.shape[0]
    ids = [used[i].reshape(S * B, -1).nonzero()[:, 1].reshape(S, B, TOP_K) for i in sorted(used)]
    return m, torch.stack(ids, 2).transpose(0, 1)


def _replay_scenario(rank, world_size, ports, model_dir, whole, done):
    from gspo_ray.trainer.routing.churn import find_routers
    from gspo_ray.trainer.worker import TrainerWorker

    out = {}
    for i, mode in enumerate(("R3", "none")):
        w = TrainerWorker(rank, world_size, "127.0.0.1", ports[i], model_dir,
                          trainer_cfg(1, lr=0.0, routing_replay=mode, routing_agreement=True, shared_prefix=False,
                                      packed_rows=False, micro_batch_size=64, router_churn_every=0),  # one forward
                          algo_cfg())
        if mode == "R3":  # the engine's weights, nothing moved: the trainer's own top-k agrees everywhere
            out["unchanged"] = w.train_step(whole)
            g = torch.Generator().manual_seed(1)
            for _, r in find_routers(w.gpt):  # only the router moves
                r.weight.data += 0.3 * torch.randn(r.weight.shape, generator=g)
            out["router_moved"] = w.train_step(whole)
        out[mode] = _used_routes(w, done, w.train_step)
        w.shutdown()
    return out


def r3_trainer_runs(model_dir: str, whole, done) -> dict:
    return run_ranks(_replay_scenario, 1, (model_dir, whole, done), n_ports=2)[0]
