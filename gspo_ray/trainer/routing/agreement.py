"""Routing agreement by version lag: per trained token, whether the trainer's top-k experts equal the top-k that
sampled it, split by how many policy versions lie between the segment's policy and the trainer.

    counts = agreement_counts(trainer_idx, sampled_idx, lag)      # pure: [T, k] ids, -1 = not recorded; lag [T]
    agreement = RoutingAgreement(model)
    with agreement.watch(mb.routes, lags, mb.lengths):             # trainer top-k vs the engine's, per layer
        forward(mb)
    metrics = agreement.metrics(group)       # {"moe/route_agree_lag0": ..., "moe/route_agree_lag1": ...,
                                             #  "moe/route_agree_lag2p": ..., "moe/route_agree_tokens_lag0": ...}

Which position: token t of a completion was drawn from the forward at position t - 1, so the routing that sampled
it is the engine's routing of position t - 1 (recorded when that position was fed to the engine, in the same
segment that sampled t), and its lag is trainer version - versions[t]. Agreement is per (token, MoE layer): the
two top-k sets equal (order ignored). The trainer's top-k is the router's own choice (top-k of `x W^T`, as
routing drift computes it), so under R3 it shows how far the unreplayed routing moved while the layers run on the
engine's. Positions the engine did not record (-1) are not compared.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from gspo_ray.trainer.routing.churn import comm_device, find_routers
from gspo_ray.trainer.routing.drift import rows_of_group_layout
from gspo_ray.trainer.routing.replay import gather_sequence, sp_offset
from gspo_ray.trainer.routing.selection import router_topk

LAG_BUCKETS = ("lag0", "lag1", "lag2p")  # 0, 1, 2 or more versions between a segment's policy and the trainer


def lag_bucket(lag: torch.Tensor) -> torch.Tensor:
    """Version lag [T] -> bucket index [T] (0, 1, 2 = two or more)."""
    return lag.clamp(min=0, max=len(LAG_BUCKETS) - 1).long()


def agreement_counts(trainer_idx: torch.Tensor, sampled_idx: torch.Tensor, lag: torch.Tensor) -> torch.Tensor:
    """[3, 2] float64 (tokens whose top-k sets agree, tokens compared) per lag bucket.

    trainer_idx, sampled_idx: [T, k] expert ids of one MoE layer (sampled: -1 on a row = not recorded, skipped);
    lag: [T] versions between the sampling policy of each token and the trainer."""
    if trainer_idx.shape != sampled_idx.shape or trainer_idx.shape[0] != lag.shape[0]:
        raise ValueError(f"shapes differ: trainer {tuple(trainer_idx.shape)}, sampled {tuple(sampled_idx.shape)}, "
                         f"lag {tuple(lag.shape)}")
    out = torch.zeros(len(LAG_BUCKETS), 2, dtype=torch.float64)
    recorded = (sampled_idx >= 0).all(-1)
    if not bool(recorded.any()):
        return out
    a = trainer_idx[recorded].long().sort(-1).values
    b = sampled_idx[recorded].long().sort(-1).values
    same = (a == b).all(-1).double()
    bucket = lag_bucket(lag[recorded])
    out[:, 0].index_add_(0, bucket, same)
    out[:, 1].index_add_(0, bucket, torch.ones_like(same))
    return out


def position_lags(versions: torch.Tensor, trainer_version: int) -> torch.Tensor:
    """versions [B, L] (version of token t; -1 where no sampled token) -> lag [B, L] at position t - 1 (the position
    whose forward drew token t); -1 where the next token was not sampled."""
    nxt = torch.full_like(versions, -1)
    nxt[:, :-1] = versions[:, 1:]
    return torch.where(nxt >= 0, trainer_version - nxt, torch.full_like(nxt, -1))


def metrics_from_counts(counts: torch.Tensor) -> dict[str, float]:
    """[layers, 3, 2] counts -> agreement per lag bucket over all layers, with its two sums per layer (tokens that
    agreed, tokens compared): sums add up over mini-batches, so the loop recomputes the share of a whole step from
    them (a bucket a mini-batch did not see must not count as 0)."""
    total = counts.sum(0)
    out = {}
    layers = max(counts.shape[0], 1)
    for j, name in enumerate(LAG_BUCKETS):
        if total[j, 1] > 0:
            out[f"moe/route_agree_{name}"] = float(total[j, 0] / total[j, 1])
            out[f"moe/route_agree_hits_{name}"] = float(total[j, 0]) / layers
            out[f"moe/route_agree_tokens_{name}"] = float(total[j, 1]) / layers
    return out


class RoutingAgreement:
    """Forward pre-hooks on every router comparing the trainer's top-k with the engine's recorded routes."""

    def __init__(self, model: torch.nn.Module):
        self.routers = find_routers(model)
        self.counts = torch.zeros(len(self.routers), len(LAG_BUCKETS), 2, dtype=torch.float64)
        self._routes: torch.Tensor | None = None  # [B, L, layers, k], -1 = not recorded
        self._lags: torch.Tensor | None = None  # [B, L], -1 = not a sampling position
        self._lengths = torch.zeros(0, dtype=torch.long)
        self._layout = None  # a GroupLayout while a group-row forward is watched
        self._handles = [r.register_forward_pre_hook(self._hook(i)) for i, (_, r) in enumerate(self.routers)]

    def _hook(self, i: int):
        def hook(module, args):
            if self._routes is None:
                return
            x = args[0].detach()  # [S_local, B, H]
            s_local, k = int(x.shape[0]), module.topk
            idx = router_topk(module, x)  # the router's selection (softmax: top-k logits; sigmoid: + expert bias)
            idx = gather_sequence(idx, module)
            if sp_offset(module, s_local) > 0:
                return  # under sequence parallelism the first TP rank counts the gathered sequence
            if self._layout is not None:  # group rows [S, R, k] -> each original row's tokens [L, B, k]
                idx = rows_of_group_layout(idx, self._layout)
            idx = idx.cpu()  # [S, B, k]
            rows = min(idx.shape[1], self._routes.shape[0])
            for b in range(rows):
                n = min(int(self._lengths[b]), idx.shape[0], self._routes.shape[1])
                if n <= 0:
                    continue
                sampled = self._routes[b, :n, i].long()
                lag = self._lags[b, :n]
                keep = lag >= 0
                if bool(keep.any()):
                    self.counts[i] += agreement_counts(idx[:n, b][keep], sampled[keep], lag[keep])
        return hook

    @contextlib.contextmanager
    def watch(self, routes: torch.Tensor | None, lags: torch.Tensor, lengths: torch.Tensor, layout=None):
        """Forwards inside compare rows' routing with `routes` ([B, L, layers, k]) at positions with lag >= 0;
        `layout`: the GroupLayout the forward runs on instead of the padded rows."""
        if routes is None or not self.routers:
            yield
            return
        if routes.shape[2] != len(self.routers):
            raise ValueError(f"engine routes have {routes.shape[2]} MoE layers, the trainer's model "
                             f"{len(self.routers)}")
        self._routes, self._lags, self._lengths, self._layout = routes, lags, lengths.cpu(), layout
        try:
            yield
        finally:
            self._routes = self._lags = self._layout = None

    def metrics(self, group=None) -> dict[str, float]:
        counts = self.counts.clone()
        self.counts.zero_()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            counts = counts.to(comm_device(group))
            dist.all_reduce(counts, group=group)
            counts = counts.cpu()
        return metrics_from_counts(counts)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
