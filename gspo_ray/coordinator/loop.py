"""The training loop: generate -> score -> advantages -> buffer -> num_iterations x num_minibatches steps -> push.

It reads like the algorithm; the pools hide Ray. In `async` mode the next rollout batch is dispatched before
training on the current one (the rollout pool keeps sampling with the previous weights), and groups sampled more
than `max_staleness` policy updates (train steps) before the policy that trains them are dropped at admission and
refilled. Versions count optimizer steps, so the buffer's bound is max_staleness x num_iterations x
num_minibatches versions: a batch's own passes never make the batch in flight stale.

A step whose samples failed too often (all of them, or above `rollout.reward.max_failed_share` for
`max_failed_steps` steps in a row) stops the run with TooManyFailedSamples (coordinator/failures.py).

With `rollout.partial`, each rollout round gives completions a token budget; groups with unfinished members
wait in a `PartialCarry` and are continued in the next round, across steps and so under newer weights, while
fresh prompts keep the pipeline full. Only finished groups reach the buffer, which applies the staleness rule.

Where the engine's log-probs anchor the ratio, the trainer scores the first mini-batch's samples of its own
version at the first step and every `anchor_gap_every` steps, before the step's first update; a gap the clip band
cannot hold stops the run there with AnchorGapTooWide (algo/anchor_gap.py has the rule), nothing trained on it.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from gspo_ray.algo.anchor_gap import anchor_gap_floor, anchor_gap_stop_line, compute_anchor_gap
from gspo_ray.algo.auto_eps import AutoEpsController
from gspo_ray.config import JobConfig
from gspo_ray.config.rollout import gpu_colocated
from gspo_ray.coordinator.buffer import AdmitStats, GroupBuffer, pack_groups
from gspo_ray.coordinator.engine_sleep import EngineSleep
from gspo_ray.coordinator.failures import FailureGuard, FailurePolicy
from gspo_ray.coordinator.partial_carry import PartialCarry, group_from_dict, group_to_dict
from gspo_ray.coordinator.step_metrics import combine_minibatches
from gspo_ray.data.records import Group, Prompt, Sample, TrainBatch, collate
from gspo_ray.coordinator.transfer_push import TransferPush
from gspo_ray.rollout.weight_sync import WeightProbe
from gspo_ray.rollout.weight_transfer import CUDA_TRANSPORTS, job_weight_transfer


class AnchorGapTooWide(RuntimeError):
    """The engine's log-probs differ from the trainer's by more than the clip band can hold (algo/anchor_gap.py):
    the run stopped before training on the batch. Its message is one line naming the gap, the band and the ways
    out."""


@dataclass
class LoopState:
    """What a checkpoint must carry besides the trainer's weights."""

    step: int = 0  # rollout batches completed
    version: int = 0  # policy version = optimizer steps taken
    prompts_drawn: int = 0
    filter_rate: float = 0.0  # running estimate, sizes the over-sampling


class Coordinator:
    """Owns one step of the loop. `rollout`, `trainer` are pools; `prompts` a PromptSource."""

    def __init__(self, cfg: JobConfig, rollout, trainer, prompts, state: LoopState):
        self.cfg, self.rollout, self.trainer, self.prompts, self.state = cfg, rollout, trainer, prompts, state
        self.versions_per_update = cfg.coordinator.num_iterations * cfg.coordinator.num_minibatches  # per batch
        self.probe_sequences: list[list[int]] | None = None  # set by the job: fixed sequences to verify pushes
        self.transport = job_weight_transfer(cfg)  # the job's transport, as coordinator/pools.py gives the engines
        self.transfer = (TransferPush(self.transport, cfg.rollout.tensor_parallel_size,
                                      int(cfg.trainer.export_bucket_mb * 2**20), cfg.rollout.push_timeout_s)
                         if self.transport in CUDA_TRANSPORTS else None)
        # colocated engines sleep while the trainer ranks on their GPUs train (coordinator/engine_sleep.py)
        colocated = gpu_colocated(cfg.rollout.num_gpus_per_worker, cfg.trainer.num_gpus_per_worker)
        self.engine_sleep = EngineSleep(rollout if colocated else None)
        if self.transfer is not None:  # the pool never holds these pushes: new engines get the live policy here
            rollout.on_new_workers = lambda workers: self.transfer.push_new(self.rollout, self.trainer, workers)
        self._fresh()

    def _fresh(self) -> None:
        """Everything a step produces besides LoopState, empty: buffer, partial carry, auto-eps band, failure
        streak, the async batch in flight, requeued prompts, push count."""
        cfg = self.cfg
        c, partial, reward = cfg.coordinator, cfg.rollout.partial, cfg.rollout.reward
        versions_per_update = self.versions_per_update
        self.partial = PartialCarry(partial) if partial is not None else None
        self.buffer = GroupBuffer(scale_by_std=cfg.algorithm.advantage.scale_by_std,
                                  adv_eps=cfg.algorithm.advantage.eps, filter_zero_adv=c.filter_zero_adv,
                                  max_staleness=None if partial else (c.max_staleness * versions_per_update
                                                                      if c.mode == "async" else 0),
                                  failure=FailurePolicy(reward.on_failure, reward.failure_reward),
                                  robust=(cfg.algorithm.advantage.robust, cfg.algorithm.advantage.clip_quantile),
                                  seed=cfg.seed, per_token=cfg.algorithm.advantage.per_token,
                                  token_baseline=cfg.algorithm.advantage.token_baseline,
                                  stale_rule=(partial.stale_policy, partial.max_staleness) if partial else None)
        self.failures = FailureGuard(reward.max_failed_share, reward.max_failed_steps)
        self.last_failures: tuple[int, int, dict[str, int]] = (0, 0, {})  # the last step's (failed, samples, reasons)
        self._pending = None  # async: the rollout batch in flight
        self._requeued: list[Prompt] = []  # prompts drawn but never trained (in flight at a checkpoint): served first
        a = cfg.algorithm  # eps auto: the band follows the drift measured on reuse mini-batches (algo/auto_eps.py)
        self.auto_eps = (AutoEpsController(eps_low=a.clip_range()[0], **a.auto_eps.model_dump())
                         if a.eps == "auto" else None)
        self.last_groups: list[Group] = []  # the groups of the last step (for rollout dumps)
        self.last_version = 0  # the policy version they were admitted (staleness-checked) and trained at
        self._pushes = 0  # weight pushes asked of this coordinator (rollout.verify_every counts them)
        self._gap_checked = False  # the engine-trainer anchor gap was checked since start (or reset)
        self._node_cache: dict = {}  # "trainer" / rollout worker id -> (its pg / actor handle, Ray node id)

    # -- one step ---------------------------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        c, t0 = self.cfg.coordinator, time.perf_counter()
        groups, metrics = self.collect_groups()
        if c.mode == "async" and self._pending is None:  # overlap: the next batch samples with the current
            self._pending = self._dispatch_round(c.prompts_per_step, metrics)  # weights while we train
        metrics.update(self.engine_sleep.sleep())  # colocated: the engines' GPU memory goes to the trainer
        metrics.update(self.train_on(groups))
        metrics.update(self.engine_sleep.wake(["weights"]))  # the push loads into them
        metrics.update(self.sync_weights())
        metrics.update(self.engine_sleep.wake(["kv_cache"]))  # after the push's buffers are freed
        self.state.step += 1
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics

    def collect_groups(self) -> tuple[list[Group], dict[str, float]]:
        """Fill the buffer with `prompts_per_step` informative groups, refilling what the filter removed."""
        c, want = self.cfg.coordinator, self.cfg.coordinator.prompts_per_step
        stats, rmetrics, t0 = AdmitStats(), {}, time.perf_counter()
        dropped = self.buffer.drop_stale(self.state.version)
        for round_ in range(c.max_refill_rounds + 1):
            missing = want - len(self.buffer)
            if missing <= 0:
                break
            pending = self._pending or self._dispatch_round(missing, rmetrics)
            self._pending = None
            groups, m = self.rollout.wait(pending)
            _accumulate(rmetrics, m)
            if self.partial is not None:
                groups = self.partial.absorb(groups)  # only whole finished groups go on
            stats.merge(self.buffer.admit(groups, self.state.version))
        if stats.offered:
            self.state.filter_rate = 1 - stats.admitted / stats.offered
        self.last_failures = (stats.failed_samples, stats.samples, dict(stats.failure_reasons))  # the console line
        self.failures.check(self.state.step + 1, stats.failed_samples, stats.samples, stats.failure_reasons)
        # fewer groups than mini-batches cannot be split: they wait in the buffer (checkpointed, staleness-checked)
        # for the next step's refill instead of being thrown away untrained
        taken = self.buffer.take(want) if len(self.buffer) >= c.num_minibatches else []
        self.last_groups, self.last_version = taken, self.state.version
        lo, hi = _version_span(taken)
        rewards = stats.rewards or [float("nan")]
        # env outcomes and the reward's other returns (sums) -> per-sample means
        for key in [k for k in rmetrics if k.startswith(("rollout/env/", "rollout/info/"))]:
            rmetrics[key] /= max(rmetrics.get("rollout/samples", 0), 1)
        return taken, {
            **rmetrics,
            "rollout/tokens_per_s": rmetrics.get("rollout/tokens", 0) / max(rmetrics.get("rollout/gen_s", 0), 1e-9),
            "rollout/mean_len": rmetrics.get("rollout/tokens", 0) / max(rmetrics.get("rollout/samples", 0), 1),
            "rollout/workers": self.rollout.num_workers,
            # job totals: prompts of dead or wedged workers sent again, replacement workers started
            "rollout/redispatched_prompts": self.rollout.redispatched,
            "rollout/worker_restarts": self.rollout.max_restarts - self.rollout.restarts_left,
            "rollout/reward_mean": sum(rewards) / len(rewards),
            "rollout/groups_offered": stats.offered, "rollout/groups_trained": len(taken),
            "rollout/filter_rate_zero_adv": stats.zero_adv / max(stats.offered, 1),
            "rollout/stale_dropped": stats.stale + dropped, "rollout/failed_samples": stats.failed_samples,
            "rollout/failed_share": stats.failed_samples / max(stats.samples, 1),
            "rollout/version_min": lo, "rollout/version_max": hi,
            "rollout/staleness_max": self.state.version - lo,  # in versions (optimizer steps)
            "rollout/staleness_max_updates": (self.state.version - lo) / self.versions_per_update,  # train steps
            **(self._partial_metrics(taken, stats) if self.partial is not None else {}),
            "time/rollout_s": time.perf_counter() - t0,
        }

    def train_on(self, groups: list[Group]) -> dict[str, float]:
        """num_iterations passes x num_minibatches optimizer steps over the same groups."""
        c, t0 = self.cfg.coordinator, time.perf_counter()
        if len(groups) < c.num_minibatches:
            return {"train/skipped": 1.0, "time/train_s": 0.0}
        old_logprobs_s = 0.0  # the old-policy forward's share of the train phase (0: the engine's anchor)
        if c.recompute_old_logprobs:
            self._recompute_old_logprobs(groups)
            old_logprobs_s = time.perf_counter() - t0
        rows, first, steps, empty = [], {}, 0, 0
        gap_due, gap = self._anchor_gap_due(), {}
        first_sight = self.state.version  # the version of the trainer's first forward over these groups
        # the version whose log-probs anchor the ratio: the trainer's own (recomputed now) or the sampling policy's
        anchor_version = self.state.version if c.recompute_old_logprobs else _version_span(groups)[0]
        for it in range(c.num_iterations):
            for mb_index, batch in enumerate(self.buffer.minibatches(groups, c.num_minibatches)):
                if not bool(batch.loss_mask.any()):  # every token masked (rollout.partial stale_rule "mask")
                    empty += 1
                    continue
                if gap_due:  # before the step's first update; stops here if the band cannot hold the gap
                    gap_due, gap = False, self._check_anchor_gap(batch, groups)
                before = self.state.version
                if self.auto_eps is None:
                    m = self.trainer.train_step(batch)
                else:
                    m = self.trainer.train_step(batch, eps=self.auto_eps.band())
                # the trainer's version is the truth: a skipped (non-finite) step leaves it where it was
                self.state.version = int(m.get("train/policy_version", before + 1))
                if self.auto_eps is not None:
                    self.auto_eps.observe_step(m, reuse=before > anchor_version,
                                               skipped=self.state.version == before)
                if it == 0 and mb_index == 0:  # shows the engine-vs-trainer anchor before any update
                    first = {f"{k}_first_mb": v for k, v in m.items() if "clip_frac" in k}
                if "moe/drift_churn" in m:  # routing drift after `steps` updates since the trainer's first sight
                    first[f"moe/drift_churn_at{steps}"] = m["moe/drift_churn"]
                    # ... which came this many versions after the batch's oldest sampling policy (0: exact, sync
                    # without partial rollouts; async / partial: drift since sampling is at least drift_churn_at{k})
                    first["moe/drift_first_sight_lag"] = float(first_sight - _version_span(groups)[0])
                rows.append(m)
                steps += 1
        self.trainer.end_batch()  # no later step sees these rows: their routing records go
        out = combine_minibatches(rows) if steps else {"train/skipped": 1.0}  # maxima by max, counts summed
        for key in [k for k in out if k.startswith("moe/route_agree_hits_")]:  # the step's share, from its sums
            lag = key.rsplit("_", 1)[1]
            out[f"moe/route_agree_{lag}"] = out[key] / out[f"moe/route_agree_tokens_{lag}"]
        out.update(first)
        out.update(gap)
        if self.auto_eps is not None:
            out.update(self.auto_eps.update())  # sets the band of the next rollout batch
        out.update({"train/optimizer_steps": steps, "train/empty_minibatches": empty, "train/version": self.state.version,
                    "time/train_s": time.perf_counter() - t0, "time/old_logprobs_s": old_logprobs_s})
        return out

    def sync_weights(self, verify: bool = False) -> dict[str, float]:
        """Export the trainer's weights and push them into every rollout engine (verified by a probe on the first
        push, every `rollout.verify_every`-th, and when `verify`). rollout.weight_transfer nccl / ipc: the trainer
        sends from its shards through vLLM's backend instead (coordinator/transfer_push.py)."""
        t0 = time.perf_counter()
        self._pushes += 1  # the first push is always checked, then every verify_every-th
        checked = verify or (self._pushes - 1) % self.cfg.rollout.verify_every == 0
        if self.transfer is not None:  # nccl / ipc: the trainer's sender drives the engines (transfer_push.py)
            m = self.transfer(self.rollout, self.trainer, self.state.version, self._probe() if checked else None)
            m["time/sync_s"] = time.perf_counter() - t0
            return m
        # the file only where an engine reads it (R9), refs where one cannot (the weights never pass here)
        trainer_node, engine_nodes = self._push_nodes()
        shared, as_refs = export_plan(self.cfg.trainer.export_shared_memory and self.transport != "object_store",
                                      trainer_node, engine_nodes, cluster_nodes() if trainer_node is not None else 1)
        export = self.trainer.export_weights(as_refs=as_refs, shared=shared)
        buckets = export.shared if export.shared is not None else export.buckets
        t1 = time.perf_counter()
        m = self.rollout.push_weights(self.state.version, buckets, probe=self._probe() if checked else None)
        m.update({"sync/export_s": t1 - t0, "time/sync_s": time.perf_counter() - t0})
        return m

    def _push_nodes(self) -> tuple[str | None, list[str | None]]:
        """(trainer rank 0's Ray node id, each rollout engine's), cached per actor: an actor never moves. None
        where unknown (pools without Ray actors, a worker that did not answer)."""
        pg = getattr(self.trainer, "pg", None)
        if pg is not None and self._node_cache.get("trainer", (None,))[0] is not pg:
            self._node_cache["trainer"] = (pg, placement_node(pg, 0))
        workers = dict(getattr(self.rollout, "workers", {}))
        new = {wid: h for wid, h in workers.items() if self._node_cache.get(wid, (None,))[0] is not h}
        for (wid, handle), node in zip(new.items(), actor_node_ids(list(new.values()))):
            if node is not None:  # no answer: asked again at the next push (the push drops a dead worker)
                self._node_cache[wid] = (handle, node)
        trainer = self._node_cache["trainer"][1] if pg is not None else None
        return trainer, [self._node_cache[wid][1] if wid in self._node_cache else None for wid in workers]

    # -- helpers ----------------------------------------------------------------------------------------------
    def _num_to_draw(self, missing: int) -> int:
        """Over-sample by the observed filter rate so one round usually suffices (at most 4x)."""
        keep = max(1 - self.state.filter_rate, 0.25)
        return max(missing, math.ceil(missing / keep))

    def _take_prompts(self, n: int) -> list[Prompt]:
        """The next n prompts: requeued ones first, then the source."""
        out, self._requeued = self._requeued[:n], self._requeued[n:]
        out += self.prompts.take(n - len(out)) if n > len(out) else []
        self.state.prompts_drawn += len(out)
        return out

    def _dispatch_round(self, missing: int, rmetrics: dict[str, float]):
        """Start one rollout round meant to yield `missing` more groups (over-sampled by the filter rate)."""
        if self.partial is not None:
            return self._dispatch_partial(missing, rmetrics)
        prompts = self._take_prompts(self._num_to_draw(missing))
        return self.rollout.submit(prompts, self.cfg.rollout.group_size, self.state.version)

    def _dispatch_partial(self, missing: int, rmetrics: dict[str, float]):
        """One partial-rollout round: continue every open group, and start fresh prompts at the fill rate
        (keeps the pipeline full), as long as at most `num_to_draw(prompts_per_step) x max_segments` groups are
        open at once."""
        p = self.cfg.rollout.partial
        carried, stale = self.partial.take_open(self.state.version)
        _accumulate(rmetrics, {"rollout/stale_dropped_samples": stale.dropped_samples})
        cap = self._num_to_draw(self.cfg.coordinator.prompts_per_step) * p.max_segments
        fresh = max(0, min(self._num_to_draw(missing), cap - len(carried)))
        prompts = self._take_prompts(fresh) if fresh else []
        return self.rollout.submit(prompts, self.cfg.rollout.group_size, self.state.version,
                                   budget=p.segment_tokens, carried=carried)

    def _partial_metrics(self, taken: list[Group], stats: AdmitStats) -> dict[str, float]:
        samples = [s for g in taken for s in g.samples]
        return {**self.partial.metrics(),
                "rollout/stale_masked_tokens": stats.stale_masked_tokens,
                "rollout/stale_dropped_samples_admit": stats.stale_dropped_samples,
                "rollout/segments_max": max((s.segments for s in samples), default=0),
                "rollout/segments_mean": sum(s.segments for s in samples) / max(len(samples), 1),
                "rollout/multi_version_samples": sum(len(set(s.versions)) > 1 for s in samples)}

    # -- checkpoints ------------------------------------------------------------------------------------------
    def reset(self, state: LoopState) -> None:
        """Forget what was produced since the checkpoint the job is about to restore (trainer recovery): the
        async batch in flight (discarded by the rollout pool: sampled under versions the checkpoint never saw),
        waiting groups, partial carry, auto-eps band, failure streak. Then `load_state_dict` the checkpoint's."""
        if self._pending is not None:
            self.rollout.discard(self._pending)
        self.state = state
        self._fresh()
        self.last_groups, self.last_version = [], state.version

    def state_dict(self) -> dict:
        """What a checkpoint needs besides LoopState and the trainer: prompts drawn but not trained yet (the
        async batch in flight), scored groups waiting in the buffer, partial rollouts' unfinished groups, the
        auto-eps band, the buffer's shuffle RNG and the failure streak."""
        fresh, carried = (self._pending.fresh, self._pending.carried) if self._pending is not None else ([], [])
        return {"requeued": [dataclasses.asdict(p) for p in self._requeued + fresh],
                "waiting": [group_to_dict(g.prompt, g.samples) for g in self.buffer.groups],
                "partial_open": ((self.partial.state_dict() if self.partial is not None else [])
                                 + [group_to_dict(p, samples) for p, samples, _ in carried]),
                "auto_eps": self.auto_eps.state_dict() if self.auto_eps is not None else None,
                "buffer_rng": self.buffer.rng_state(), "failures": self.failures.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`; waiting groups are admitted again under the resumed version (staleness
        rules and advantages apply as if they had waited in memory)."""
        self._requeued = [Prompt(**p) for p in state.get("requeued", [])]
        waiting = [Group(prompt=p, samples=ss) for p, ss in map(group_from_dict, state.get("waiting", []))]
        self.buffer.admit(waiting, self.state.version)
        if self.partial is not None:
            self.partial.load_state_dict(state.get("partial_open", []))
        if self.auto_eps is not None and state.get("auto_eps"):
            self.auto_eps.load_state_dict(state["auto_eps"])
        if state.get("buffer_rng"):  # checkpoints before 2026-12-06 have neither: re-seeded, streak 0
            self.buffer.load_rng_state(state["buffer_rng"])
        if state.get("failures"):
            self.failures.load_state_dict(state["failures"])

    def _probe(self):
        """(token ids, trainer log-probs) of fixed sequences: each engine checks its own log-probs against them.
        Temperature 1 on both sides: the engine's teacher-forced log-probs are unscaled."""
        seqs = self.probe_sequences
        if not self.cfg.rollout.verify_push or not seqs:
            return None
        batch = collate([_probe_sample(ids) for ids in seqs], [[0.0] * (len(ids) - 1) for ids in seqs])
        logp = self.trainer.compute_logprobs(batch, temperature=1.0, purpose="probe")
        return WeightProbe([list(ids) for ids in seqs], [logp[i, 1:len(ids)].tolist() for i, ids in enumerate(seqs)])

    def _anchor_gap_due(self) -> bool:
        """The engine's log-probs anchor the ratio and this is the first step since start (or reset), or one of
        every `coordinator.anchor_gap_every` steps after it (steps 1, 1 + N, 1 + 2N, ...)."""
        c = self.cfg.coordinator
        if c.recompute_old_logprobs:
            return False
        return not self._gap_checked or (c.anchor_gap_every > 0 and self.state.step % c.anchor_gap_every == 0)

    def _check_anchor_gap(self, batch: TrainBatch, groups: list[Group]) -> dict[str, float]:
        """The trainer's log-probs of `batch`'s samples of its current version against the engine's (one no-grad
        forward, `train/forward_passes_anchor_gap`), judged by algo/anchor_gap.py's rule against the band in force:
        a fixed band stops the run (AnchorGapTooWide) where it cannot hold the gap; eps auto keeps its band at
        least anchor_gap_floor from now on, and stops only where that floor is above auto_eps.max_eps. No sample
        of the current version (async mode after step 1): `train/anchor_gap_samples` 0 and no other value."""
        self._gap_checked = True
        version, a = self.state.version, self.cfg.algorithm
        by_uid = {f"{s.prompt_uid}/{s.sample_index}": s for g in groups for s in g.samples}
        rows = [i for i, uid in enumerate(batch.uids) if _sampled_at(by_uid[uid], version)]
        if not rows:
            return {"train/anchor_gap_samples": 0.0}
        batch = batch.select(rows)
        logp = self.trainer.compute_logprobs(batch, purpose="anchor_gap")
        level, ctl = a.importance_sampling_level, self.auto_eps
        band = ctl.band() if ctl is not None else a.clip_range()
        gap = compute_anchor_gap(logp, batch.old_logp, batch.loss_mask, *band, level=level)
        floor = anchor_gap_floor(gap, level)
        if ctl is None and floor > band[0] or ctl is not None and floor > ctl.max_eps:
            raise AnchorGapTooWide(anchor_gap_stop_line(gap, band, level, self.state.step + 1,
                                                        None if ctl is None else ctl.max_eps))
        if ctl is None:
            return gap.metrics()
        # auto: its band never narrows below what leaves the gap its share (until the next check measures again)
        ctl.min_eps = max(a.auto_eps.min_eps, floor)
        if ctl.eps_low < floor:
            ctl.eps_low = floor
            gap = compute_anchor_gap(logp, batch.old_logp, batch.loss_mask, *ctl.band(), level=level)
        return gap.metrics() | {"train/anchor_gap_band_floor": floor}

    def _recompute_old_logprobs(self, groups: list[Group]) -> None:
        """Anchor the ratio on the trainer's log-probs (the `recompute_old_logprobs` switch); the engine's stay in
        `Sample.logprobs` as the behaviour policy of mismatch corrections."""
        batch: TrainBatch = pack_groups(groups)
        logp = self.trainer.compute_logprobs(batch)
        row = 0
        for g in groups:
            for s in g.samples:
                p = len(s.prompt_ids)
                s.old_logprobs = logp[row, p:p + s.num_tokens].tolist()
                row += 1


def _probe_sample(ids: list[int]) -> Sample:
    """The probe as a one-token prompt whose 'completion' is the rest: trainer log-probs of ids[1:]."""
    rest = ids[1:]
    return Sample(prompt_uid="probe", sample_index=0, prompt_ids=ids[:1], completion_ids=rest,
                  logprobs=[0.0] * len(rest), loss_mask=[1] * len(rest), versions=[0] * len(rest),
                  finish_reason="stop")


def _sampled_at(sample: Sample, version: int) -> bool:
    """Every trained token of `sample` was sampled by policy `version` (none trained: False)."""
    trained = [v for v, m in zip(sample.versions, sample.loss_mask) if m]
    return bool(trained) and all(v == version for v in trained)


def _accumulate(into: dict[str, float], new: dict[str, float]) -> None:
    for k, v in new.items():
        into[k] = into.get(k, 0.0) + float(v)


def _version_span(groups: list[Group]) -> tuple[int, int]:
    spans = [g.version_span() for g in groups] or [(0, 0)]
    return min(s[0] for s in spans), max(s[1] for s in spans)


def export_plan(shared_memory: bool, trainer_node: str | None, engine_nodes: list[str | None],
                nodes: int = 1) -> tuple[bool, bool]:
    """(shared, as_refs) of a weight export (TrainerWorker.export_weights). The shared-memory file is read only by
    engines on trainer rank 0's node, so it is written only when one is there (with separate rollout nodes it would
    cost a host copy of the model per push and shmem for the job's life, read by nobody). Object-store refs are made
    when an engine is elsewhere, and on a cluster of `nodes` > 1 anyway: the pool hands the last push to a
    replacement or added worker, which Ray may place on another node. An unknown node (None) may be either."""
    if trainer_node is None or not engine_nodes:
        return shared_memory, True
    here = any(n is None or n == trainer_node for n in engine_nodes)
    elsewhere = any(n != trainer_node for n in engine_nodes)  # None too
    shared = shared_memory and here
    return shared, elsewhere or not shared or nodes > 1


def cluster_nodes() -> int:
    """Alive nodes of the Ray cluster this driver is connected to."""
    import ray

    return sum(1 for node in ray.nodes() if node.get("Alive"))


def placement_node(pg, bundle: int) -> str | None:
    """The Ray node id a placement group's bundle was placed on (the trainer pool's bundle i holds rank i)."""
    from ray.util import placement_group_table

    return placement_group_table(pg).get("bundles_to_node_id", {}).get(bundle)


def _node_of_actor(_actor) -> str:
    from gspo_ray.data.shared_weights import current_node_id

    return current_node_id()


def actor_node_ids(handles: list, timeout_s: float = 60.0) -> list[str | None]:
    """Each actor's Ray node id (asked of the actor through Ray's `__ray_call__`; a rollout worker takes it between
    engine calls, max_concurrency 2); None for one that does not answer in time (dead: the push drops it)."""
    if not handles:
        return []
    import ray

    refs = [h.__ray_call__.remote(_node_of_actor) for h in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref) if ref in ready else None)
        except ray.exceptions.RayError:
            out.append(None)
    return out
