"""Routing drift: the share of a token's top-k expert choices that differ between the policy that first saw a
sequence (the sampling policy, when old log-probs are recomputed in sync mode) and the policy being updated now, per
MoE layer.

    drift = RoutingDrift(model)
    with drift.watch(keys, mb.lengths):                # the first forward over a key stores its routing;
        forward(mb)                                    # every later one is compared with it (None: padding)
    metrics = drift.metrics(group)                     # {"moe/drift_churn_l0": ..., "moe/drift_churn": ...,
                                                       #  "moe/drift_tokens": tokens compared}

This is seed 000's "~10% of the experts a rollout activates change after one gradient update", measured the way
it matters for reuse: mini-batch j of pass p trains on routing that moved for (p-1) x num_minibatches + j
optimizer steps. The routing compared is the router's own selection (`routing.selection.router_topk`: top-k of
the logits for a softmax router, of sigmoid scores + expert bias for a DeepSeekMoE one), computed from the router's
input even when Routing Replay overrides what the layer uses (so under R2 this still shows how far the unreplayed
routing has moved, while the layer runs on the recorded one).

Shared-prefix group rows (trainer.shared_prefix): `watch(..., layout=...)` reads each original row's tokens out of
its group row (`layout.row_of`, `layout.col_of`), so a shared prompt token counts once per completion that uses it,
exactly as on padded rows, and records are per original row either way.

Which forward stores: the first one that sees a uid. With `coordinator.recompute_old_logprobs` in sync mode that
is the old-log-prob forward over the whole rollout batch, run by the policy that sampled it (exact). Without it, the
first training forward stores: exact for the first mini-batch, a lower bound for the later ones of pass 1. In
async mode (and with partial rollouts) the first sight is already a later policy than the sampling one: the loop
logs how many versions later (`moe/drift_first_sight_lag`), and drift since sampling is at least what this
measures (docs/moe.md). Records live for the current rollout batch only (`routing.records.RecordStore`).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from gspo_ray.compat.megatron_import import megatron_core  # noqa: F401  (first: megatron without torch.compile)
from megatron.core import parallel_state

from gspo_ray.trainer.routing.churn import comm_device, find_routers
from gspo_ray.trainer.routing.records import RecordStore
from gspo_ray.trainer.routing.replay import gather_sequence, sp_offset
from gspo_ray.trainer.routing.selection import router_topk


def rows_of_group_layout(idx: torch.Tensor, layout) -> torch.Tensor:
    """Top-k ids of a group-row forward [W, R, k] -> those of each original row's tokens [L, B, k]: token t of
    row b sits at column col_of[b, t] of group row row_of[b] (columns past a row's length read column 0; the
    callers mask by length)."""
    cols = layout.col_of.clamp(min=0).to(idx.device)  # [B, L]
    return idx[cols.T, layout.row_of.to(idx.device)[None, :]]


class RoutingDrift:
    """Per sequence uid and MoE layer: the top-k ids [length, k] of its first forward, and the changed-choice
    counts of every later forward since the last `metrics()`."""

    def __init__(self, model: torch.nn.Module):
        self.routers = find_routers(model)
        self.store = RecordStore(len(self.routers))  # the current rollout batch's first sights
        self.counts = torch.zeros(len(self.routers), 2, dtype=torch.float64)  # (changed choices, k * tokens)
        self._uids: list[str | None] | None = None
        self._lengths = torch.zeros(0, dtype=torch.long)
        self._layout = None  # a GroupLayout while a group-row forward is watched
        self._handles = [r.register_forward_pre_hook(self._hook(i)) for i, (_, r) in enumerate(self.routers)]

    def _hook(self, i: int):
        def hook(module, args):
            if self._uids is None:
                return
            x = args[0].detach()  # [S_local, B, H]
            s_local, batch, k = int(x.shape[0]), int(x.shape[1]), module.topk
            idx = router_topk(module, x)  # [S_local, B, k]
            idx = gather_sequence(idx, module)
            if sp_offset(module, s_local) > 0:
                return  # under sequence parallelism the first TP rank counts the gathered sequence
            if self._layout is not None:  # group rows [S, R, k] -> each original row's tokens [L, B, k]
                idx = rows_of_group_layout(idx, self._layout)
                batch = idx.shape[1]
            idx = idx.sort(dim=-1).values.cpu().to(torch.int16)  # [S, B, k]
            uids, lengths = self._uids[:batch], self._lengths[:batch]
            compare = []
            for b, uid in enumerate(uids):
                if uid is None or int(lengths[b]) == 0:  # a padding row or dummy (a copy of row 0): not counted
                    continue
                if not self.store.record(uid, i, idx[:int(lengths[b]), b].clone()) and uid in self.store \
                        and len(self.store[uid]) > i:  # seen before: compare with its first sight
                    compare.append(b)
            if not compare:
                return
            old = torch.full((idx.shape[0], len(compare), k), -1, dtype=torch.int16)
            for j, b in enumerate(compare):
                st = self.store[uids[b]][i]
                old[:st.shape[0], j] = st
            valid = torch.arange(idx.shape[0])[:, None] < lengths[compare][None, :]  # [S, R]
            same = (old[:, :, :, None] == idx[:, compare, None, :]).any(-1).sum(-1)  # [S, R]
            self.counts[i, 0] += float(((k - same) * valid).sum())
            self.counts[i, 1] += float(valid.sum()) * k
        return hook

    @contextlib.contextmanager
    def watch(self, uids: list[str | None], lengths: torch.Tensor, layout=None):
        """Forwards inside store (first sight) or compare (later) the routing of rows `uids` (lengths [B]; None: a
        padding row or dummy, ignored); `layout`: the GroupLayout the forward runs on instead of the padded rows."""
        if not self.routers:
            yield
            return
        self.store.drop_partial(uids)  # a partial record (an interrupted forward) starts over
        self._uids, self._lengths, self._layout = list(uids), lengths.cpu(), layout
        try:
            yield
        finally:
            self._uids, self._layout = None, None

    def fetch(self, keys: list[str | None], mine: set[int], group=None) -> int:
        """The first sights of the rows this DP rank forwards now come to it, so a row compares against its first
        sight whichever rank saw it (collective; `RecordStore.fetch`)."""
        return self.store.fetch(keys, mine, group)

    def end_batch(self) -> None:
        self.store.end_batch()

    def metrics(self, group=None) -> dict[str, float]:
        """Drift per layer and the mean over layers since the last call, summed over `group`'s ranks; {} when
        nothing was compared (a dense model, or every forward was a first sight)."""
        counts = self.counts.clone()
        self.counts.zero_()
        if dist.is_available() and dist.is_initialized():
            counts = counts.to(comm_device(group))
            dist.all_reduce(counts, group=group)
            counts = counts.cpu()
        if not self.routers or counts[:, 1].sum() == 0:
            return {}
        drift = (counts[:, 0] / counts[:, 1].clamp(min=1)).tolist()
        out = {f"moe/drift_churn_l{layer}": d for (layer, _), d in zip(self.routers, drift)}
        out["moe/drift_churn"] = sum(drift) / len(drift)
        # tokens compared (each row's tokens once; without sequence parallelism every TP rank counts its rows)
        router = self.routers[0][1]
        tp = 1 if router.config.sequence_parallel else parallel_state.get_tensor_model_parallel_world_size()
        out["moe/drift_tokens"] = float(counts[0, 1]) / router.topk / tp
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
