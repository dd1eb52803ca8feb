"""The routing-noise probe (trainer.routing_noise): how much of log r_t routing change alone causes, measured on
every mini-batch of a run that trains *without* Routing Replay.

    probe = RoutingNoiseProbe(model)                    # model built with routing_replay=True (RouterReplay)
    with probe.sampler(keys, lengths):                  # old-log-prob pass (if any): the sampling policy records
        forward(mb)
    logp_free = forward(mb)                             # the training forward: routing the routers pick now
    probe.measure(keys, lengths, lambda: forward(mb), logp_free, old_logp, adv, mask, record_first=...)
    metrics = probe.metrics(dp_group)                   # moe/routing_logratio_*, moe/*_clips_removed, ...

`measure` runs one more no-grad forward with the current weights and the routing recorded at each sequence's
first forward (R2's records: `routing.replay.RoutingReplay`), so logp_free - logp_held is the routing-induced
part of the log-ratio (algo/routing_noise.py). Sync mode without partial rollouts only (config refuses the rest:
there the first sight is a later policy and the probe would read 0). First sight: with
`coordinator.recompute_old_logprobs` the old-log-prob pass (the sampling policy, exact); without, the first mini-batch's probe forward (exact for it, a
lower bound for the later mini-batches of pass 1, as for R2 and routing drift). Records follow a sequence across
DP ranks (`fetch`); counts add up over micro-batches and DP ranks before they become shares. The probe forward
runs on every micro-batch, also on one with nothing scored (a dummy, a fully masked one: its counts are 0), so
that EP ranks run the same number of all-to-alls.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from gspo_ray.algo.routing_noise import (COUNT_KEYS, merge_routing_noise_counts, routing_noise_counts,
                                         routing_noise_metrics)
from gspo_ray.trainer.routing.churn import comm_device, find_routers
from gspo_ray.trainer.routing.replay import RoutingReplay


class RoutingNoiseProbe:
    def __init__(self, model: torch.nn.Module):
        self.replay = RoutingReplay(find_routers(model))
        self.counts: dict[str, float] = {}

    @property
    def store(self):
        """The probe's RecordStore (its replay's)."""
        return self.replay.store

    def sampler(self, keys: list[str | None], lengths: torch.Tensor):
        """Around the sampling policy's forward (old-log-prob recompute): records the rows it sees first, and
        replays nothing (the old log-probs are those of the routing the policy picks)."""
        return self.replay.recording(keys, lengths)

    @torch.no_grad()
    def measure(self, keys: list[str | None], lengths: torch.Tensor, forward: Callable[[], torch.Tensor],
                logp_free: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                record_first: bool | None = None) -> None:
        """`forward()` -> [B, L] log-probs of the micro-batch's padded rows, run here with each row's recorded
        routing (recorded now for rows seen the first time; record_first as in `RoutingReplay.forward`); adds
        this micro-batch's counts (0 where `mask` scores nothing)."""
        with self.replay.forward(keys, lengths, record_fn=forward, record_first=record_first):
            logp_held = forward()
        part = routing_noise_counts(logp_free.detach().float(), logp_held.float(), old_logp.float(), adv.float(),
                                    mask.bool())
        self.counts = merge_routing_noise_counts(self.counts, part)

    def metrics(self, group=None) -> dict[str, float]:
        """The mini-batch's metrics from every micro-batch and DP rank (collective over `group`); resets."""
        counts, self.counts = self.counts, {}
        summed = [k for k in COUNT_KEYS if k != "abs_d_max"]
        sums = torch.tensor([counts.get(k, 0.0) for k in summed], dtype=torch.float64)
        peak = torch.tensor([counts.get("abs_d_max", 0.0)], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            sums, peak = sums.to(comm_device(group)), peak.to(comm_device(group))
            dist.all_reduce(sums, group=group)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            sums, peak = sums.cpu(), peak.cpu()
        total = dict(zip(summed, sums.tolist()))
        total["abs_d_max"] = float(peak[0])
        return routing_noise_metrics(total)

    def fetch(self, keys: list[str | None], mine: set[int], group=None) -> int:
        """The records of the rows this DP rank forwards now come to it (collective; `RecordStore.fetch`)."""
        return self.replay.fetch(keys, mine, group)

    def end_batch(self) -> None:
        self.replay.end_batch()
