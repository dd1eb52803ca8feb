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
R3 (`EngineRoutingReplay`) replays the inference engine's routing instead: the records are the routes the engine
returned with each sample (`TrainBatch.routes`, loaded before every policy forward over a batch), so every training
forward, the first included, routes each position as the engine did when it sampled, whichever segment (policy
version) that was. Positions the engine never computed (-1) route as the trainer's router picks. R3 also replays
on shared-prefix group rows (`forward(..., layout=...)`): each row's routes go to the columns that hold its tokens
(`layout.col_of`), so a shared prefix column gets its routes once; the layout's prefix ends where the rows' routes
disagree (group_rows.prefix_groups(match_routes=True)), so every row's recorded routes are the ones replayed.
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
from gspo_ray.trainer.routing.selection import router_topk

MODES = ("none", "R2", "R3")


def build_routing_replay(model: torch.nn.Module, mode: str) -> "RoutingReplay | None":
    """None for mode "none" (or a dense model); RoutingReplay for "R2"."""
    if mode not in MODES:
        raise ValueError(f"trainer.routing_replay {mode!r}; valid: {MODES}")
    routers = find_routers(model)
    if mode == "none" or not routers:
        return None
    return EngineRoutingReplay(routers) if mode == "R3" else RoutingReplay(routers)


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

    free_fill = False  # R3: positions without a record route as the router picks (R2: padding only, any experts)

    def __init__(self, routers):
        self.routers = routers
        for layer, r in routers:
            if r.router_replay is None:
                raise ValueError(f"router of layer {layer} has no RouterReplay: build the model with routing_replay")
        self.store = RecordStore(len(routers))  # key -> one int16 [length, k] per MoE layer
        self._uids: list[str | None] = []
        self._lengths = torch.zeros(0, dtype=torch.long)
        self._layout = None  # R3: the GroupLayout of a group-row forward (None: padded rows)
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
            if self.free_fill:  # the router's own selection where nothing is recorded (selection.router_topk)
                target = router_topk(module, args[0]).cpu()
            else:
                target = torch.arange(k).repeat(s_local, batch, 1)  # padding positions: any k distinct experts
            if self._layout is not None:
                self._group_target(target, i, offset)
            for b, uid in enumerate(self._uids[:batch] if self._layout is None else ()):
                record = self.store.lookup(uid)
                if record is None:  # a padding row or dummy: nothing to replay
                    continue
                stored = record[i]
                end = min(offset + s_local, stored.shape[0])
                if end > offset:
                    part = stored[offset:end].long()
                    if self.free_fill:
                        have = part[:, 0] >= 0
                        target[:end - offset, b][have] = part[have]
                    else:
                        target[:end - offset, b] = part
            rr = module.router_replay
            rr.set_target_indices(target.reshape(-1, k).to(args[0].device))
            rr.replay_backward_list.clear()  # only used with activation recompute; set_target_indices appends
        return hook

    def _group_target(self, target: torch.Tensor, i: int, offset: int) -> None:
        """Write layer i's recorded routes of the micro-batch's rows into `target` [S_local, R, k] of a group-row
        forward (this rank's columns offset.. under sequence parallelism): token t of row b sits at column
        col_of[b, t] of group row row_of[b]; a shared prefix column takes the first recorded row's routes."""
        layout, s_local = self._layout, target.shape[0]
        written = torch.zeros(target.shape[:2], dtype=torch.bool)
        for b, uid in enumerate(self._uids):
            record = self.store.lookup(uid)
            if record is None:  # a dummy row: routed freely
                continue
            stored = record[i].long()
            n = min(int(self._lengths[b]), stored.shape[0])
            cols = layout.col_of[b, :n] - offset
            g = int(layout.row_of[b])
            keep = (stored[:n, 0] >= 0) & (cols >= 0) & (cols < s_local)
            keep &= ~written[cols.clamp(0, s_local - 1), g]
            target[cols[keep], g] = stored[:n][keep]
            written[cols[keep], g] = True

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
    def _acting(self, action, uids, lengths, layout=None):
        self._uids, self._lengths, self._layout = list(uids), lengths.cpu(), layout
        self._set_action(action)
        try:
            yield
        finally:
            self._set_action(None)
            self._uids, self._layout = [], None

    def needs_recording_pass(self, uids: list[str | None]) -> bool:
        """Whether a forward of rows `uids` (None: padding) mixes recorded and new rows, so that `forward` must
        record the new ones first."""
        real = [u for u in uids if u is not None]
        new = sum(not self.store.known(u) for u in real)
        return 0 < new < len(real)

    @contextlib.contextmanager
    def forward(self, uids: list[str | None], lengths: torch.Tensor, record_fn: Callable[[], object] | None = None,
                record_first: bool | None = None, layout=None):
        """Forwards inside use the recorded routing of rows `uids` (lengths [B]; None: a padding row, routed
        freely); new rows are recorded first. record_first: run the recording forward `record_fn` now (agreed
        over the ranks, see the module docstring); None decides from these rows alone. layout: the GroupLayout
        the forward runs on instead of the padded rows (R3 only: R2 records per padded row)."""
        if len(uids) != len(lengths):
            raise ValueError(f"routing replay needs one uid per row: {len(uids)} uids, {len(lengths)} rows")
        if layout is not None and not self.free_fill:
            raise ValueError("R2 records and replays per padded row: no group-row layout")
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
        with self._acting(action, uids, lengths, layout):
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


class EngineRoutingReplay(RoutingReplay):
    """R3: the records are the engine's routes, loaded from each batch (`load`) before its policy forwards; every
    forward over a loaded row replays them (nothing is recorded from the trainer's own forwards)."""

    free_fill = True

    def load(self, keys: list[str | None], routes: torch.Tensor | None, lengths: torch.Tensor) -> int:
        """Records of rows `keys` from `routes` [B, L, layers, k] (-1 = not recorded); returns rows loaded. A row
        already loaded keeps its record (the same sample comes back in a later mini-batch or pass)."""
        if routes is None:
            raise ValueError("trainer.routing_replay 'R3': the batch carries no engine routes (the engines must "
                             "return them: rollout.capture_routes)")
        n_layers, k = int(routes.shape[2]), int(routes.shape[3])
        want_k = self.routers[0][1].topk
        experts = self.routers[0][1].config.num_moe_experts
        if n_layers != len(self.routers) or k != want_k or int(routes.max()) >= experts:
            raise ValueError(f"trainer.routing_replay 'R3': the engine's routes have {n_layers} MoE layers x top-{k} "
                             f"(expert ids up to {int(routes.max())}), the trainer's model {len(self.routers)} x "
                             f"top-{want_k} of {experts} experts")
        loaded = 0
        for b, key in enumerate(keys):
            if key is None or self.store.known(key):
                continue
            n = int(lengths[b])
            self.store.records[key] = [routes[b, :n, i].clone() for i in range(n_layers)]
            loaded += 1
        return loaded

    def needs_recording_pass(self, uids: list[str | None]) -> bool:
        return False  # nothing is recorded from the trainer's forwards
