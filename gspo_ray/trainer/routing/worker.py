"""What a TrainerWorker does with MoE routing around its forwards: Routing Replay (R2 / R3), routing drift, the
routing-noise probe, routing agreement and router churn, each built when its trainer option is on (and, all but
Replay, only on a model with routers).

    routing = TrainerRouting(gpt, trainer_cfg, forward, dp_group, world_size)
    passes = routing.fetch(batch, mbs)                      # collective, before a policy forward over `batch`
    with routing.records(mb, sampler, record_first): ...    # Replay, then drift (the probe too), around a forward
    with routing.agreement_watch(mb, version): ...          # trainer top-k vs the engine's, training forwards
    with routing.churn_capture(mb, "before"): ...           # router churn's record of the step's routing
    metrics = routing.step_metrics(mbs, churn)              # after the step: churn (a re-forward), drift, probe, ...
    routing.end_batch(); routing.record_bytes(); routing.close()

`forward(model, mb, purpose, **kw)` is the worker's counted log-prob forward (TrainerWorker._logprobs): the
recording forwards of Replay ("routing_record") and churn's re-forward ("router_churn") go through it, so they
count in the worker's `forward_passes` like every other forward.

Pipeline parallelism (trainer.pp > 1): each stage watches its own layers' routers (global layer numbers), the
worker enters `records` / `churn_capture` around each micro-batch's forward inside the schedule, churn's re-forward
is a forward-only pass of the schedule, and the drift and churn counts are summed over the stage's ranks, then the
stages' per-layer metrics joined (the means over layers taken again over all of them). Replay, the noise probe and
agreement are not built there (TrainerConfig.pipeline_problem).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
from gspo_ray.compat.megatron_import import megatron_core  # noqa: F401  (first: megatron without torch.compile)
from megatron.core import parallel_state

from gspo_ray.data.records import TrainBatch
from gspo_ray.trainer.batch_layout import MicroBatch, routing_keys
from gspo_ray.trainer.group_rows import shard_token_order
from gspo_ray.trainer.pipeline import pipeline_size, run_pipeline
from gspo_ray.trainer.routing.agreement import RoutingAgreement, position_lags
from gspo_ray.trainer.routing.churn import RouterRecorder, comm_device
from gspo_ray.trainer.routing.drift import RoutingDrift
from gspo_ray.trainer.routing.noise_probe import RoutingNoiseProbe
from gspo_ray.trainer.routing.replay import build_routing_replay


class TrainerRouting:
    """The routing observers of one trainer rank and what runs around its forwards (see the module docstring)."""

    def __init__(self, gpt: torch.nn.Module, trainer_cfg, forward: Callable, dp_group, world_size: int):
        self.gpt, self.forward, self.dp_group, self.world_size = gpt, forward, dp_group, world_size
        self.mode, self.churn_every = trainer_cfg.routing_replay, trainer_cfg.router_churn_every
        self.recorder = RouterRecorder(gpt)
        self.replay = build_routing_replay(gpt, trainer_cfg.routing_replay)  # None unless R2 on an MoE
        self.drift = RoutingDrift(gpt) if trainer_cfg.routing_drift and self.recorder.routers else None
        self.noise = RoutingNoiseProbe(gpt) if trainer_cfg.routing_noise and self.recorder.routers else None
        # trainer top-k vs the engine's per trained token, by version lag (where batches carry the engine's routes)
        self.agreement = RoutingAgreement(gpt) if self.recorder.routers and (
            trainer_cfg.routing_agreement or trainer_cfg.routing_replay == "R3") else None
        # under PP a stage may hold no router (a dense first layer): whether the model has any, agreed by all
        self.pp = pipeline_size()
        self.any_routers = bool(self.recorder.routers)
        if self.pp > 1:
            flag = torch.tensor([float(self.any_routers)], device=comm_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self.any_routers = bool(flag.item())

    # ---- per-row records (R2, drift, probe) ----------------------------------------------------------------------
    def stores(self) -> list:
        """The observers that keep per-row records (R2, drift, probe)."""
        return [x for x in (self.replay, self.drift, self.noise) if x is not None]

    def end_batch(self) -> None:
        """Forget the rollout batch's routing records."""
        for records in self.stores():
            records.end_batch()

    def record_bytes(self) -> int:
        """Bytes of routing records (R2, drift, probe) this rank holds."""
        return sum(r.store.nbytes() for r in self.stores())

    @staticmethod
    def row_keys(micro: MicroBatch) -> list[str | None]:
        """Routing keys of a micro-batch's rows; None for padding rows and dummies (copies of row 0, which must not
        store or compare as row 0 a second time)."""
        return [k if r >= 0 else None for k, r in zip(routing_keys(micro.batch), micro.rows)]

    def fetch(self, batch: TrainBatch, mbs: list[MicroBatch]) -> list[tuple[bool, bool]]:
        """Before a policy forward over `batch` (collective): the routing records of the rows this DP rank forwards
        come to it from the rank that holds them (rows change DP rank between calls); then, per micro-batch,
        whether R2's and the probe's held forward run a recording forward first, agreed over all ranks so that
        EP ranks run the same forwards (each MoE layer's forward is an all-to-all)."""
        stores = self.stores()
        if not stores:
            return [(False, False)] * len(mbs)
        keys = routing_keys(batch)
        mine = {r for mb in mbs for r in mb.rows if r >= 0}
        for records in stores:
            records.fetch(keys, mine, self.dp_group)
        if self.mode == "R3" and self.replay is not None:  # the engine's routes are the records
            self.replay.load([k if b in mine else None for b, k in enumerate(keys)], batch.routes, batch.lengths)
        holders = (self.replay, None if self.noise is None else self.noise.replay)
        flags = torch.tensor([[h is not None and h.needs_recording_pass(self.row_keys(mb)) for h in holders]
                              for mb in mbs], dtype=torch.uint8).reshape(len(mbs), 2)
        if self.world_size > 1 and any(h is not None for h in holders):
            flags = flags.to(comm_device())
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            flags = flags.cpu()
        return [(bool(a), bool(b)) for a, b in flags.tolist()]

    # ---- around a forward ----------------------------------------------------------------------------------------
    def records(self, micro: MicroBatch, sampler: bool = False,
                record_first: bool | None = None) -> contextlib.ExitStack:
        """Routing Replay, then routing drift, around a policy forward of `micro` (one set of row keys for both;
        Replay on padded rows only, see TrainerWorker._plan). sampler: the sampling policy's forward (old-log-prob
        recompute), where the routing-noise probe records too. record_first: see `replayed`."""
        stack = contextlib.ExitStack()
        probe = self.noise if sampler else None
        if self.replay is None and self.drift is None and probe is None:
            return stack
        if micro.layout is not None and ((self.replay is not None and self.mode == "R2") or probe is not None):
            raise RuntimeError("R2 records per padded row: _plan must not give group rows here")
        keys = self.row_keys(micro)
        if probe is not None:
            stack.enter_context(probe.sampler(keys, micro.batch.lengths))
        stack.enter_context(self.replayed(micro, keys, record_first))  # first: its recording forward is not watched
        if self.drift is not None:
            stack.enter_context(self.drift.watch(keys, micro.batch.lengths, layout=micro.layout))
        return stack

    def replayed(self, micro: MicroBatch, keys: list[str | None] | None = None, record_first: bool | None = None):
        """Routing Replay around a policy forward of `micro` (records its routing the first time; see
        routing.replay). record_first: whether a recording forward runs first, agreed over the ranks (`fetch`);
        None decides from this rank's rows."""
        if self.replay is None:
            return contextlib.nullcontext()
        return self.replay.forward(keys or self.row_keys(micro), micro.batch.lengths,
                                   record_fn=lambda: self.forward(self.gpt, micro, "routing_record",
                                                                  loss_tokens_only=True),
                                   record_first=record_first, layout=micro.layout)

    def agreement_watch(self, micro: MicroBatch, version: int):
        """Routing agreement (trainer top-k vs the engine's, by version lag) around a training forward of `micro`;
        the lag of position t - 1 is the trainer's `version` minus the version that sampled token t."""
        mb = micro.batch
        if self.agreement is None or mb.routes is None or mb.versions is None:
            return contextlib.nullcontext()
        lags = position_lags(mb.versions, version)
        real = torch.tensor([r >= 0 for r in micro.rows])[:, None]  # dummies (copies of row 0) compare nothing
        lags = torch.where(real & mb.loss_mask.bool().roll(-1, dims=1), lags, -1)  # trained tokens only
        return self.agreement.watch(mb.routes, lags, mb.lengths, layout=micro.layout)

    # ---- router churn --------------------------------------------------------------------------------------------
    def churn_now(self, version: int) -> bool:
        """Whether the step that starts at policy `version` measures router churn (trainer.router_churn_every)."""
        every = self.churn_every
        return bool(every) and self.any_routers and version % every == 0

    @contextlib.contextmanager
    def churn_capture(self, mb: MicroBatch, phase: str):
        """RouterRecorder.capture around a forward of `mb`. After a group-row forward the recorded routing maps
        (one entry per real group-row token of this rank's shard) are re-expanded to the rows' own tokens, so
        churn counts each prefix token once per row that uses it, as padded rows do (dummy rows count nothing)."""
        if mb.layout is None:
            with self.recorder.capture(mb.batch.lengths, phase):
                yield
            return
        with self.recorder.capture(mb.layout.lengths, phase):
            yield
        width = mb.layout.tokens.shape[1]
        s_local, offset = width, 0
        if self.gpt.config.sequence_parallel:  # each TP rank's routers see one shard of the positions
            s_local = width // parallel_state.get_tensor_model_parallel_world_size()
            offset = parallel_state.get_tensor_model_parallel_rank() * s_local
        lengths = torch.where(torch.tensor(mb.rows) >= 0, mb.batch.lengths, 0)
        order = shard_token_order(mb.layout, lengths, s_local, offset)
        for maps in self.recorder.maps[phase].values():
            maps[-1] = maps[-1][order]

    @torch.no_grad()
    def router_churn(self, mbs: list[MicroBatch]) -> dict[str, float]:
        """Re-run the step's micro-batches with the new weights and compare top-k choices (see routing.churn)."""
        self.gpt.eval()

        def forward(mb):
            with self.replayed(mb), self.churn_capture(mb, "after"):
                return self.forward(self.gpt, mb, "router_churn")

        if self.pp > 1:
            run_pipeline(self.gpt, mbs, forward, lambda mb, out: (out.sum() * 0.0, None), forward_only=True)
        else:
            for mb in mbs:
                forward(mb)
        self.gpt.train()
        # all ranks (of the stage): DP rows and SP shards are disjoint token sets
        metrics = self.recorder.churn_metrics(self._stage_group())
        self.recorder.clear()
        return metrics

    def _stage_group(self):
        """The ranks that hold this rank's layers (None: all ranks, at PP 1)."""
        if self.pp == 1:
            return None
        return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)

    def step_metrics(self, mbs: list[MicroBatch], churn: bool) -> dict[str, float]:
        """After a step's optimizer update (collective): router churn (when `churn`, re-forwarding `mbs`), drift,
        the probe's and agreement's metrics of the step, each where it is on."""
        metrics = {}
        if churn:
            metrics |= self.router_churn(mbs)
        if self.drift is not None:
            metrics |= self.drift.metrics(self._stage_group())  # all ranks (of the stage), like churn
        if self.pp > 1:
            metrics = join_stage_metrics(metrics)
        if self.noise is not None:
            metrics |= self.noise.metrics(self.dp_group)
        if self.agreement is not None:
            metrics |= self.agreement.metrics(self.dp_group)
        return metrics

    def close(self) -> None:
        """Remove the router hooks."""
        self.recorder.remove()


# per-layer metric prefix -> the mean over layers it feeds (routing/churn.py, routing/drift.py)
LAYER_MEANS = {"moe/router_churn_l": "moe/router_churn", "moe/drift_churn_l": "moe/drift_churn",
               "moe/expert_load_max_over_mean_l": "moe/expert_load_max_over_mean"}


def join_stage_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Every pipeline stage's routing metrics joined (collective over the pipeline group): the per-layer values
    side by side (each layer on one stage), each mean over layers taken again over all the stages' layers."""
    parts = [None] * pipeline_size()
    dist.all_gather_object(parts, metrics, group=parallel_state.get_pipeline_model_parallel_group())
    joined = {k: v for part in parts for k, v in part.items()}
    for prefix, mean in LAYER_MEANS.items():
        values = [v for k, v in joined.items() if k.startswith(prefix)]
        if values:
            joined[mean] = sum(values) / len(values)
    return joined
