"""TrainerWorker: one rank of the Megatron trainer (plain class; `pool.py` wraps it with `ray.remote`).

    w = TrainerWorker(rank, world_size, "127.0.0.1", port, model_dir, trainer_cfg, algo_cfg, run_dir)
    metrics = w.train_step(batch)          # one optimizer step on one mini-batch (collective)
    logp = w.compute_logprobs(batch)       # [B, L], no grad (collective)
    export = w.export_weights()            # WeightExport(version, buckets of (HF name, tensor)) on rank 0

Every public method is collective: all ranks call it with the same arguments (the whole mini-batch; each rank
picks its own rows).

Loss scaling. The objective of a step is `compute_policy_loss` on the whole mini-batch. With aggregation
seq-mean-token-mean it is `1/N_seq * sum_i mean_t l_it` over the N_seq sequences of the mini-batch (token-mean:
`1/N_tok * sum_it l_it`). A micro-batch's `compute_policy_loss` divides by its own n_seq (n_tok), so it is scaled
by `n_seq / N_seq` (`n_tok / N_tok`); the scaled micro-batch losses of all micro-batches and all DP ranks sum to the
mini-batch loss. Megatron DDP then *averages* grads over DP, so each rank backpropagates `dp * scaled loss`.
N_seq and N_tok come from the full mini-batch, which every rank holds, so no extra collective is needed.
Context parallelism (trainer.cp): the CP ranks of a DP rank take the same micro-batches, each forwarding its
columns of the rows (trainer/context_parallel.py); the log-probs are summed over them, so the loss is the same on
each, and a parameter's gradient is the SUM of their partial gradients. Megatron's DDP averages over DP x CP, so
each rank backpropagates `dp * cp * scaled loss`.

Shared prefixes (trainer.shared_prefix). The completions of one prompt are forwarded as one group row [prompt |
c_1 | ... | c_G] (trainer/group_rows.py): exact, the prompt computed once. Micro-batches still carry their rows in
the original [b, L] layout and `forward_group_logprobs` returns log-probs there, so the loss, its scaling and the
metrics above are unchanged; DP ranks take group rows dealt by cost (batch_layout.plan_ranks) and pad with fully
masked dummy micro-batches to equal forward counts. Policy forwards that record routing per row (Routing Replay R2, routing drift) use padded
rows (logged once); router churn works on group rows (prefix tokens counted once per row that uses them).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from gspo_ray.compat.megatron_import import megatron_core  # noqa: F401  (first: megatron without torch.compile)
from megatron.core import parallel_state

from gspo_ray.algo import compute_policy_loss
from gspo_ray.data.records import TrainBatch
from gspo_ray.trainer.checkpoints import checkpoint as ckpt
from gspo_ray.trainer.checkpoints import shards
from gspo_ray.trainer.optim import (
    build_ddp,
    build_optimizer,
    build_scheduler,
    SkippedSteps,
    optimizer_step,
    torch_dtype,
    zero_grads,
)
from gspo_ray.compat.megatron_cpu import cpu_device_mode
from gspo_ray.trainer.batch_layout import (
    MicroBatch,
    group_micro_batches,
    loss_units,
    model_score_weight,
    row_micro_batches,
)
from gspo_ray.trainer.group_rows import warn_once
from gspo_ray.trainer.heap import release_free_heap
from gspo_ray.trainer.lora.worker import TrainerLoRA, check_checkpoint_kind, load_model, model_state
from gspo_ray.trainer.memory import stage_layer_range
from gspo_ray.trainer.metric_accumulator import MetricAccumulator, dp_token_metrics
from gspo_ray.trainer.pg_weights import build_pg_weight
from gspo_ray.trainer.pipeline import (
    from_last_stage,
    is_last_stage,
    pipeline_size,
    run_pipeline,
    tensor_from_last_stage,
)
from gspo_ray.trainer.routing.churn import comm_device
from gspo_ray.trainer.routing.worker import TrainerRouting
from gspo_ray.trainer.weights.bridge import is_tied_output_copy, sync_tied_output
from gspo_ray.trainer.weights.stage_names import global_layer_name, local_layer_name
from gspo_ray.trainer.weights.weight_export import WeightExport, WeightExporter

log = logging.getLogger(__name__)


class TrainerWorker:
    """One rank of the trainer: Megatron GPTModel in DDP, AdamW, LR schedule, optional frozen reference policy."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path: str | Path,
                 trainer_cfg, algo_cfg, run_dir: str | Path | None = None, temperature: float = 1.0):
        from gspo_ray.trainer.model import build_model, resolve_use_te
        from gspo_ray.trainer.parallel import init_distributed

        self.rank, self.world_size = rank, world_size
        self.cfg, self.algo = trainer_cfg, algo_cfg
        if trainer_cfg.num_threads is not None:  # Ray sets OMP_NUM_THREADS to the actor's num_cpus
            torch.set_num_threads(trainer_cfg.num_threads)
        self.model_path, self.run_dir = Path(model_path), Path(run_dir) if run_dir is not None else None
        self.eps_low, self.eps_high = algo_cfg.clip_range()
        if algo_cfg.aggregation == "seq-mean-token-sum-norm" and algo_cfg.norm_len is None:
            raise ValueError("algorithm.norm_len must be set for aggregation 'seq-mean-token-sum-norm' (a constant, "
                             "e.g. rollout.max_new_tokens, which the job fills in): the padded batch width varies")
        init_distributed(rank, world_size, master_addr, master_port, tp=trainer_cfg.tp, ep=trainer_cfg.ep,
                         cp=trainer_cfg.cp, pp=trainer_cfg.pp,
                         seed=trainer_cfg.seed, timeout_s=trainer_cfg.collective_timeout_s)
        dtype = torch_dtype(trainer_cfg.dtype)
        self.gpt, self.spec = build_model(self.model_path, dtype=dtype, moe_dispatcher=trainer_cfg.moe_dispatcher,
                                          routing_replay=trainer_cfg.routing_replay != "none"
                                          or trainer_cfg.routing_noise, use_te=resolve_use_te(trainer_cfg.use_te),
                                          attention=trainer_cfg.attention_kernel,
                                          router_bias_update_rate=trainer_cfg.router_bias_update_rate,
                                          recompute=trainer_cfg.recompute,
                                          recompute_num_layers=trainer_cfg.recompute_num_layers,
                                          recompute_modules=trainer_cfg.recompute_modules)
        self.lora = None  # trainer.lora: the base frozen, adapters trained and pushed (trainer/lora/worker.py)
        if trainer_cfg.lora is not None:
            self.lora = TrainerLoRA.attach(self.gpt, self.spec, trainer_cfg.lora, trainer_cfg.seed)
        self.ddp = build_ddp(self.gpt, dtype=trainer_cfg.dtype,
                             use_distributed_optimizer=trainer_cfg.distributed_optimizer,
                             grad_reduce_in_fp32=trainer_cfg.grad_reduce_in_fp32)
        self.optimizer = build_optimizer(self.ddp, trainer_cfg)
        self.scheduler = build_scheduler(self.optimizer, trainer_cfg)
        self.ref_model = None
        if algo_cfg.beta > 0 and self.lora is not None:
            self.ref_model = self.gpt  # its starting adapters (or none) under self._reference(): no second model
        elif algo_cfg.beta > 0:
            # frozen copy of the initial weights; no DDP, no optimizer
            self.ref_model, _ = build_model(self.model_path, dtype=dtype, moe_dispatcher=trainer_cfg.moe_dispatcher,
                                            use_te=resolve_use_te(trainer_cfg.use_te),
                                            attention=trainer_cfg.attention_kernel)
            self.ref_model.eval()
            self.ref_model.requires_grad_(False)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()  # CP ranks excluded: they share a DP rank's rows
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        # Routing Replay, drift, the noise probe, agreement, router churn (trainer/routing/worker.py); their
        # forwards go through self._logprobs, looked up at each call
        self.routing = TrainerRouting(self.gpt, trainer_cfg, lambda *a, **kw: self._logprobs(*a, **kw),
                                      self.dp_group, world_size)
        self.replay, self.drift, self.noise = self.routing.replay, self.routing.drift, self.routing.noise
        if self.cp_size > 1 and self.routing.recorder.routers and (trainer_cfg.routing_drift
                                                                   or trainer_cfg.router_churn_every):
            raise NotImplementedError("trainer.routing_drift / trainer.router_churn_every under trainer.cp > 1: "
                                      "they record routing per token of whole rows (preflight refuses them too)")
        self.exporter = WeightExporter(rank)  # export_weights (weights/weight_export.py)
        self.forward_passes: dict[str, int] = {}  # model forwards since the last train_step returned, by kind
        self.forward_tokens: dict[str, int] = {}  # and the tokens they computed (padding included)
        self._version = 0
        self.skipped = SkippedSteps(trainer_cfg.max_skipped_steps)  # non-finite steps: skipped, then fatal
        self.temperature = temperature  # the rollout's sampling temperature: log-probs of logits / T
        # pipeline parallelism (trainer/pipeline.py): the loss and metrics live on the last stage
        self.pp, self.last_stage = pipeline_size(), is_last_stage()
        problem = trainer_cfg.pipeline_problem(self.spec.is_moe)
        if problem:
            raise ValueError(problem)

    # ---- queries -------------------------------------------------------------------------------------------------
    def version(self) -> int:
        """Policy version: the number of optimizer steps taken."""
        return self._version

    def layout(self) -> dict:
        """This rank's place in the TP/EP/DP grid (what its model shard depends on)."""
        ps = parallel_state
        return {"rank": self.rank, "tp": self.cfg.tp, "ep": self.cfg.ep, "dp_rank": self.dp_rank,
                "tp_rank": ps.get_tensor_model_parallel_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
                "ep_rank": ps.get_expert_model_parallel_rank(), "etp_rank": ps.get_expert_tensor_parallel_rank()}

    # ---- forward helpers -----------------------------------------------------------------------------------------
    def _logprobs(self, model, mb: MicroBatch, purpose: str, with_entropy: bool = False,
                  loss_tokens_only: bool = False, temperature: float | None = None):
        """[B, L] log-probs of mb.batch.tokens (and [B, L] entropies, detached, when with_entropy), computed on its
        group rows when it has a layout. loss_tokens_only: score only loss-masked tokens (others read 0): the output
        layer then skips prompt positions. temperature: of the scored distribution (default: the rollout's sampling
        temperature). purpose: what the forward is for ("train", "reference", "old_logprobs", "probe",
        "router_churn"), counted in `forward_passes` (and its tokens in `forward_tokens`) so benchmarks and tests
        see every forward a rollout batch costs."""
        from gspo_ray.trainer.logprobs import forward_group_logprobs, forward_logprobs

        rows = mb.batch
        score_mask = rows.loss_mask.bool() if loss_tokens_only else None
        self.forward_passes[purpose] = self.forward_passes.get(purpose, 0) + 1
        self.forward_tokens[purpose] = self.forward_tokens.get(purpose, 0) + mb.num_tokens
        kw = dict(with_entropy=with_entropy, score_mask=score_mask, head_dtype=self.cfg.head_dtype,
                  temperature=self.temperature if temperature is None else temperature)
        if mb.layout is None:
            out = forward_logprobs(model, rows.tokens, rows.lengths, **kw)
        else:
            out = forward_group_logprobs(model, rows.tokens, rows.lengths, mb.layout, **kw)
        if not self.last_stage:  # a pipeline stage's hidden states, for the next stage (trainer/pipeline.py)
            return out
        if not with_entropy:
            return out.float()
        logp, entropy = out
        return logp.float(), entropy.detach().float()

    def _reference(self):
        """Around a forward of self.ref_model: with LoRA that is the policy model with its starting adapters."""
        return self.lora.as_reference(self.gpt) if self.lora is not None else contextlib.nullcontext()

    def _plan(self, batch: TrainBatch, policy_routing: bool) -> list[MicroBatch]:
        """This DP rank's micro-batches of `batch`: shared-prefix group rows when trainer.shared_prefix is on and
        the batch has prompts to share, else one row per sample; each micro-batch one packed row when
        trainer.packed_rows is on. policy_routing: a policy forward that Routing Replay / routing drift watch. R2
        (and the probe, which holds R2's records) records and replays per padded row, so with it that forward keeps
        padded rows; R3 replays the engine's routes on group rows (not packed) whose shared prefix ends where the
        rows' routes disagree; drift reads each row's tokens out of the group rows or the packed row."""
        cfg = self.cfg
        share, packed = cfg.shared_prefix, cfg.packed_rows
        r2 = self.replay is not None and cfg.routing_replay == "R2"
        r3 = policy_routing and self.replay is not None and cfg.routing_replay == "R3"
        if (share or packed) and policy_routing and (r2 or self.noise is not None):
            warn_once("routing_rows", "shared_prefix / packed_rows: policy forwards use padded rows while Routing "
                      "Replay (or the routing-noise probe) records and replays routing per row")
            share = packed = False
        packed = packed and not r3  # R3's replay places routes by group row or padded row; packed rows not built
        from gspo_ray.trainer.logprobs import width_multiple

        multiple = width_multiple(self.gpt)  # TP under sequence parallelism, times 2 x CP
        weight = model_score_weight(self.gpt.config)
        if share:
            mbs = group_micro_batches(batch, self.dp_rank, self.dp_size, cfg.micro_batch_size,
                                      cfg.micro_batch_tokens, multiple, weight, packed, match_routes=r3)
            if mbs is not None:
                return mbs
        return row_micro_batches(batch, self.dp_rank, self.dp_size, cfg.micro_batch_size, cfg.micro_batch_tokens,
                                 packed, multiple, weight)

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, reference: bool = False, temperature: float | None = None,
                         purpose: str = "old_logprobs") -> torch.Tensor:
        """log p(tokens[b, t] | tokens[b, :t]) of the current (or reference) policy: [B, L] float32 on CPU, 0 at
        t = 0 and past each row's length. Every rank returns the whole batch (gathered over DP).
        temperature: default the sampling one; the weight-push probe asks for 1 (vLLM's prompt log-probs)."""
        model = self.ref_model if reference else self.gpt
        if model is None:
            raise ValueError("compute_logprobs(reference=True) needs algorithm.beta > 0 (no reference model)")
        was_training = model.training
        model.eval()
        width = batch.tokens.shape[1]
        out = torch.zeros(batch.num_sequences, width)
        sampler = purpose == "old_logprobs" and not reference  # the policy that sampled: R2 and drift record
        mbs = self._plan(batch, policy_routing=sampler)
        kind = "reference" if reference else purpose
        passes = self.routing.fetch(batch, mbs) if sampler else [(False, False)] * len(mbs)
        first = {id(mb): record_first for mb, (record_first, _) in zip(mbs, passes)}

        def forward(mb):
            with self.routing.records(mb, sampler=True, record_first=first[id(mb)]) if sampler else \
                    self._reference() if reference else contextlib.nullcontext():
                return self._logprobs(model, mb, kind, temperature=temperature)

        if self.pp > 1:  # forward only through the stages; the last one's log-probs reach every stage below
            lps = run_pipeline(model, mbs, forward, lambda mb, lp: (lp.sum() * 0.0, lp.cpu()), forward_only=True)
        else:
            lps = [forward(mb).cpu() for mb in mbs]
        for mb, lp in zip(mbs, lps):
            real = [i for i, r in enumerate(mb.rows) if r >= 0]  # padding rows and dummies are dropped
            out[[mb.rows[i] for i in real], :lp.shape[1]] = lp[real]
        if self.pp > 1:
            out = tensor_from_last_stage(out.to(comm_device(self.dp_group))).cpu()
        model.train(was_training)
        valid = torch.arange(width)[None, :] < batch.lengths.reshape(-1, 1)
        if self.dp_size > 1:  # each row was computed by exactly one DP rank; the others hold 0 there
            out = out.to(comm_device(self.dp_group))
            dist.all_reduce(out, group=self.dp_group)
            out = out.cpu()
        return torch.where(valid, out, 0.0)

    # ---- training ------------------------------------------------------------------------------------------------
    def _micro_step(self, micro: MicroBatch, totals: float, norm_len: float, acc: MetricAccumulator,
                    churn: bool, eps: tuple[float, float], passes: tuple[bool, bool] = (False, False)) -> None:
        """Forward, loss and backward of one micro-batch; grads accumulate in DDP's buffers. The loss is computed
        on micro.batch's rows in their original layout, whichever layout the forward used."""
        mb = micro.batch
        ref_logp = mb.ref_logp
        if ref_logp is None and self.ref_model is not None:
            with torch.no_grad(), self._reference():
                ref_logp = self._logprobs(self.ref_model, micro, "reference", loss_tokens_only=True)
        capture = self.routing.churn_capture(micro, "before") if churn else contextlib.nullcontext()
        # replay first: a recording forward it runs is neither captured nor watched
        with self.routing.records(micro, record_first=passes[0]), capture, \
                self.routing.agreement_watch(micro, self._version):
            # a micro-batch with nothing to train (a dummy that keeps the ranks' collectives in step) scores
            # every token, so its loss (times weight 0) still has a graph and its backward runs the same all-to-alls
            logp, entropy = self._logprobs(self.gpt, micro, "train", with_entropy=True,
                                           loss_tokens_only=bool(mb.loss_mask.any()))
        if self.noise is not None:  # the same rows with their recorded routing; on every micro-batch (EP in step)
            scored = bool(mb.loss_mask.any())
            self.noise.measure(self.routing.row_keys(micro), mb.lengths,
                               lambda: self._logprobs(self.gpt, micro, "routing_noise", loss_tokens_only=scored),
                               logp, mb.old_logp.to(logp), mb.adv.to(logp), mb.loss_mask.bool().to(logp.device),
                               record_first=passes[1])
        self._micro_loss(micro, logp, entropy, ref_logp, totals, norm_len, acc, eps).backward()

    def _micro_loss(self, micro: MicroBatch, logp, entropy, ref_logp, totals: float, norm_len: float,
                    acc: MetricAccumulator, eps: tuple[float, float]) -> torch.Tensor:
        """The scaled loss of one micro-batch, what its backward starts from (module doc, "Loss scaling"); its
        metrics go into `acc`."""
        mb, a = micro.batch, self.algo
        old_logp, adv, mask = mb.old_logp.to(logp), mb.adv.to(logp), mb.loss_mask.bool().to(logp.device)
        # dilution mask / mismatch correction (None when both are off); their metrics join the loss's
        rollout_logp = None if mb.rollout_logp is None else mb.rollout_logp.to(logp)
        pg_weight, extra = build_pg_weight(logp, old_logp, rollout_logp, adv, mask, a, *eps)
        loss, metrics = compute_policy_loss(
            logp, old_logp, adv, mask, a.importance_sampling_level, *eps, dual_clip_c=a.dual_clip_c,
            aggregation=a.aggregation, ref_logp=None if ref_logp is None else ref_logp.to(logp),
            beta=a.beta, kl_estimator=a.kl_estimator, entropy=entropy, norm_len=norm_len, pg_weight=pg_weight)
        metrics |= extra
        n_units = loss_units(mb.loss_mask, a.aggregation)
        weight = n_units / totals if totals > 0 else 0.0
        acc.add(metrics, metrics["train/n_tokens"], metrics["train/n_seqs"], n_units)
        acc.add_sum("train/loss", float(loss.detach()) * weight)
        # DDP averages grads over DP x CP: multiply by dp x cp so the step follows the sum of the DP ranks' scaled
        # losses (the CP ranks' partial gradients of one loss add up to its gradient)
        return loss * (weight * self.dp_size * self.cp_size)

    def _pipeline_micro_steps(self, mbs: list[MicroBatch], totals: float, norm_len: float, acc: MetricAccumulator,
                              churn: bool, eps: tuple[float, float]) -> None:
        """The micro-batches' forwards and backwards through the pipeline's 1F1B schedule (trainer/pipeline.py):
        the loss of each on the last stage, as _micro_step computes it. A reference model's log-probs come first,
        from a forward-only pass of its own."""
        refs = [mb.batch.ref_logp for mb in mbs]
        if self.ref_model is not None and any(r is None for r in refs):
            with torch.no_grad(), self._reference():
                computed = run_pipeline(self.ref_model, mbs, lambda mb: self._logprobs(
                    self.ref_model, mb, "reference", loss_tokens_only=True), lambda mb, lp: (lp.sum() * 0.0, lp),
                    forward_only=True)
            if computed:  # the last stage's (the others score nothing)
                refs = [c if r is None else r for r, c in zip(refs, computed)]
        ref_of = {id(mb): ref for mb, ref in zip(mbs, refs)}

        def forward(micro):  # the routing observers built under PP (drift, churn) watch this stage's routers
            capture = self.routing.churn_capture(micro, "before") if churn else contextlib.nullcontext()
            with self.routing.records(micro), capture:
                return self._logprobs(self.gpt, micro, "train", with_entropy=True,
                                      loss_tokens_only=bool(micro.batch.loss_mask.any()))

        def loss(micro, output):
            logp, entropy = output
            return self._micro_loss(micro, logp, entropy, ref_of[id(micro)], totals, norm_len, acc, eps), None

        run_pipeline(self.gpt, mbs, forward, loss)

    def train_step(self, batch: TrainBatch, eps: tuple[float, float] | None = None) -> dict[str, float]:
        """One optimizer step on one mini-batch (collective). Returns mini-batch metrics, equal on every rank.
        eps: (eps_low, eps_high) of this step (algorithm.eps auto sets it); None = the configured band."""
        t0 = time.perf_counter()
        self._check_batch(batch)
        a = self.algo
        totals = loss_units(batch.loss_mask, a.aggregation)
        norm_len = None if a.norm_len is None else float(a.norm_len)  # a constant (see __init__), never the width
        churn = self.routing.churn_now(self._version)
        mbs = self._plan(batch, policy_routing=True)
        passes = self.routing.fetch(batch, mbs)
        acc = MetricAccumulator(per_sequence_ratio=a.importance_sampling_level != "token")
        self.gpt.train()
        zero_grads(self.ddp, self.optimizer)
        self.routing.recorder.clear()
        eps = tuple(eps) if eps is not None else (self.eps_low, self.eps_high)
        if self.pp > 1:
            self._pipeline_micro_steps(mbs, totals, norm_len, acc, churn, eps)
        else:
            for mb, extra in zip(mbs, passes):
                self._micro_step(mb, totals, norm_len, acc, churn, eps, extra)
        # at PP > 1 only the last stage has a loss: the others' "finite" is joined to its in grads_finite
        loss_finite = math.isfinite(acc.sums.get("train/loss", 0.0))
        grad_norm, lr, ok = optimizer_step(self.ddp, self.optimizer, self.scheduler, loss_finite)
        if ok:
            self._version += 1
        else:
            log.warning("skipped step (non-finite loss or gradients); policy version stays %d", self._version)
        self.skipped.record(ok, self._version)  # raises after trainer.max_skipped_steps in a row
        metrics = acc.reduce(self.dp_group)
        if self.pp > 1:  # the loss's metrics are the last stage's
            metrics = from_last_stage(metrics)
        metrics |= self.routing.step_metrics(mbs, churn)  # router churn (a re-forward), drift, probe, agreement
        metrics |= {"train/eps_low": eps[0], "train/eps_high": eps[1]}  # the band this step trained with
        metrics |= {f"train/forward_passes_{k}": float(v) for k, v in self.forward_passes.items()}
        # tokens the training forwards computed over DP, padding included (shared prefixes lower them), and the
        # busiest rank's share (train/dp_imbalance)
        metrics |= dp_token_metrics(self.forward_tokens.get("train", 0), self.dp_group)
        metrics["train/row_tokens"] = float(batch.lengths.sum())  # the mini-batch's tokens as one row per sample
        self.forward_passes, self.forward_tokens = {}, {}
        metrics |= {"train/grad_norm": grad_norm, "train/lr": lr, "train/step_ok": float(ok),
                    "train/skipped_steps": float(self.skipped.total),
                    "train/policy_version": float(self._version), "train/step_s": time.perf_counter() - t0}
        return metrics

    def end_batch(self) -> None:
        """The rollout batch's passes are done (the coordinator says so): forget its routing records, and give the
        step's freed heap back to the OS while this rank waits for the next batch (trainer/heap.py)."""
        self.routing.end_batch()
        release_free_heap()

    def routing_record_bytes(self) -> int:
        """Bytes of routing records (R2, drift, probe) this rank holds."""
        return self.routing.record_bytes()

    def _check_batch(self, batch: TrainBatch) -> None:
        b, width = batch.tokens.shape
        for name in ("loss_mask", "old_logp", "adv"):
            t = getattr(batch, name)
            if tuple(t.shape) != (b, width):
                raise ValueError(f"TrainBatch.{name} has shape {tuple(t.shape)}, tokens {(b, width)}")
        if batch.ref_logp is not None and tuple(batch.ref_logp.shape) != (b, width):
            raise ValueError(f"TrainBatch.ref_logp has shape {tuple(batch.ref_logp.shape)}, tokens {(b, width)}")
        if b == 0 or not batch.loss_mask.any():
            # an Adam step on zero gradients would still move the weights (momentum): refuse instead
            raise ValueError(f"TrainBatch of {b} rows has no loss-masked token to train on")

    # ---- weights and checkpoints ---------------------------------------------------------------------------------
    def export_weights(self, bucket_mb: float | None = None, as_refs: bool = False,
                       shared: bool = False) -> WeightExport:
        """Full HF-named weights (collective: gathers TP/EP shards). Rank 0 gets contiguous CPU copies in buckets.
        as_refs: rank 0 puts each bucket in the object store and returns the refs instead, so the weights go
        straight from this process to the rollout workers (one bucket at a time), never through the caller.
        shared: rank 0 writes them into its shared-memory file and returns `shared` (a SharedWeights record that
        engines on its node map, rollout/weight_sync.py); with as_refs too, the refs ride along as its fallback."""
        from gspo_ray.trainer.weights.bridge import export_hf_weights

        bucket_mb = bucket_mb if bucket_mb is not None else self.cfg.export_bucket_mb
        source = (self.lora.weights(self.gpt, self.spec, bucket_mb) if self.lora is not None
                  else export_hf_weights(self.gpt, self.spec, bucket_mb=bucket_mb))
        return self.exporter.export(source, self._version, bucket_mb, as_refs=as_refs, shared=shared)

    def save(self, ckpt_dir: str | Path) -> str:
        """This rank's share of model + optimizer (each byte written by one rank, checkpoints/shards.py), its scheduler
        position, version and RNG states (collective)."""
        layouts = [None] * self.world_size
        dist.all_gather_object(layouts, self.layout())
        owners = shards.Owners(layouts, self.rank)
        fp32 = torch_dtype(self.cfg.dtype) == torch.float32
        payload = {
            "model": shards.owned_model_state(self._global_state(), owners),  # adapters only with LoRA
            "optimizer": shards.optimizer_pieces(self.optimizer, self._param_names(), owners, fp32),
            "scheduler": self.scheduler.state_dict(),
            "version": self._version,
            "rng": ckpt.capture_rng_state(),
            "layout": layouts[self.rank],
        }
        meta = {"format": shards.FORMAT, "world_size": self.world_size, "tp": self.cfg.tp, "ep": self.cfg.ep,
                "dtype": self.cfg.dtype, "version": self._version, "layouts": layouts,
                "distributed_optimizer": self.cfg.distributed_optimizer,
                "lora": self.lora.meta() if self.lora is not None else None, "layers": self._layers(),
                "pp": self.pp, "pp_layers": self._stage_layers()}
        return str(ckpt.save_checkpoint(ckpt_dir, self.rank, payload, meta))

    def _stage_layers(self) -> list[list[int]]:
        """[first, end) global layer indices of each pipeline stage, in stage order (checkpoint meta: which saved
        stage holds a layer): the even split every stage was built by (memory.stage_layer_range)."""
        stages = [stage_layer_range(self.spec.num_layers, self.pp, s) for s in range(self.pp)]
        return [[r.start, r.stop] for r in stages]

    def _global_state(self) -> dict:
        """The checkpoint's model state under global names (stage_names.py), without the last stage's copy of a
        tied embedding (the first stage's is the tensor; `_load_global_state` restores the copy from it)."""
        offset = self.gpt.layer_offset
        return {global_layer_name(k, offset): v for k, v in model_state(self.gpt, self.lora).items()
                if not is_tied_output_copy(self.gpt, k)}

    def _load_global_state(self, state: dict, where: str) -> None:
        offset = self.gpt.layer_offset
        local = {local_layer_name(k, offset): v for k, v in state.items()}
        if self.lora is None:  # the tied copy: its current value, then the first stage's embedding
            local |= {k: v for k, v in self.gpt.state_dict().items() if is_tied_output_copy(self.gpt, k)}
        load_model(self.gpt, local, self.lora, where)
        sync_tied_output(self.gpt)

    def _layers(self) -> dict:
        from gspo_ray.trainer.model import layer_kinds

        kinds = layer_kinds(self.gpt)  # what was built (the TE spec, grouped experts), not what was asked
        return {"te": kinds.te, "grouped_gemm": kinds.grouped_gemm}

    def _param_names(self) -> dict[int, str]:
        """id(param) -> its checkpoint name: global (stage_names.py); a tied embedding's last-stage copy, whose
        optimizer state equals the embedding's (same values, gradients summed over both), under the embedding's."""
        offset = self.gpt.layer_offset
        return {id(p): "embedding.word_embeddings.weight" if is_tied_output_copy(self.gpt, name)
                else global_layer_name(name, offset) for name, p in self.gpt.named_parameters()}

    def load(self, ckpt_dir: str | Path, load_optimizer: bool = True) -> int:
        """Restore a checkpoint written by `save` (collective). Returns the restored policy version.

        Model and optimizer load from any DP / TP / EP layout (checkpoints/shards.py reshards them); the scheduler
        position and RNG states come from the saved rank with this rank's number when the layouts match, else from
        one with its TP/EP coordinates. A checkpoint of the older layout (every rank a full replica) loads where it
        can; `ckpt.legacy_problem` says why not otherwise. Everything is read before the
        model or optimizer changes: a missing slice leaves them as they were.
        """
        meta = ckpt.read_meta(ckpt_dir)
        check_checkpoint_kind(meta, self.lora, str(ckpt_dir))
        ckpt.check_layers(meta, self._layers(), str(ckpt_dir))
        lay, fp32 = self.layout(), torch_dtype(self.cfg.dtype) == torch.float32
        if meta.get("format") == shards.FORMAT:
            saved = shards.SavedShards(ckpt_dir, meta, self.spec, lambda d, r: ckpt.load_rank_payload(d, r, mmap=True))
            state = saved.model_state(lay, self._global_state())  # read whole before anything changes
            if load_optimizer:
                saved.load_optimizer(self.optimizer, self._param_names(), lay, fp32)
            payload = saved.payload(ckpt.state_source(meta, lay))
        else:  # the older layout: a full replica per rank (same TP/EP; see ckpt.legacy_problem for the optimizer)
            if self.pp > 1:
                raise ValueError(f"checkpoint {ckpt_dir} has the older layout (every rank a full replica): it loads "
                                 "at trainer.pp 1 only")
            problem = ckpt.legacy_problem(meta, self.cfg.tp, self.cfg.ep, self.world_size,
                                          self.cfg.distributed_optimizer, ckpt.legacy_was_distributed(ckpt_dir),
                                          str(ckpt_dir)) if load_optimizer else None
            if problem:
                raise ValueError(problem)
            state = ckpt.load_model_state(ckpt_dir, lay)
            payload = ckpt.load_rank_payload(ckpt_dir, ckpt.state_source(meta, lay))
            if load_optimizer:
                ckpt.load_optimizer_state(self.optimizer, payload["optimizer"])
        self._load_global_state(state, str(ckpt_dir))
        if load_optimizer:
            self.scheduler.num_steps = 0  # config values stay; only the position in the schedule is restored
            self.scheduler.step(payload["scheduler"]["num_steps"])
            ckpt.restore_rng_state(payload["rng"])
        if fp32 or not load_optimizer:
            with cpu_device_mode():
                self.optimizer.reload_model_params()  # main (fp32) params follow the loaded model
        self._version = int(meta["version"])
        dist.barrier()
        return self._version

    def shutdown(self) -> None:
        from gspo_ray.trainer.parallel import destroy_distributed

        self.routing.close()
        self.exporter.close()  # the shared weight file goes with its last mapping
        destroy_distributed()
