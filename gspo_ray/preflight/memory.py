"""The preflight's memory check: a job whose trainer rank will not fit its device is refused before Ray starts.

    plan = job_memory_plan(cfg, hf_config)          # the job's layout, its terms, the device it must fit
    check_memory(cfg, hf_config, report)            # PreflightError (one line) or a report line

The terms are the memory model's (trainer/memory.py), for the job's model (its config.json read through
model_spec.spec_from_hf_config and the family registry, as the trainer builds it) and layout (trainer.num_workers,
tp, ep, recompute, dtype, the distributed optimizer, optimizer offload; micro_batch_tokens, else micro_batch_size
rows of rollout.max_model_len; every token counted as scored, an upper bound on the logits). The device:
`trainer.device_memory_gb`, else the GPU's memory on CUDA (a GPU pool), else, on a CPU pool, this host's memory
shared by the trainer ranks (a warning only: the CPU pool may span other hosts, and the OS pages); a job fits in
USABLE_SHARE (90%) of it (the CUDA context, NCCL buffers and allocator fragmentation are not terms). A colocated
engine (both pools on fractions of a GPU) keeps rollout.gpu_memory_utilization of the device.

The refusal: one line with the per-rank GiB, the largest term and the cheapest layout that fits on as many
ranks (trainer/layout_plan.fitting_layouts: TP, EP, CP, PP, recompute, micro_batch_tokens, offload; CP and PP
named where the layout has them), or that none does (more ranks needed). With trainer.pp the terms are the busiest
pipeline stage's. A layout is offered only where the job could run at it (`job_layout_check`: the trainer
section's validators and the preflight's model checks on the job with the layout's fields), e.g. no CP for an MoE
that keeps routing_drift on, no PP for a model whose layers it does not divide.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError

from gspo_ray.config import JobConfig, TrainerConfig
from gspo_ray.config.rollout import gpu_colocated, resolve_gpu_memory_utilization
from gspo_ray.preflight.job_model import check_trainer_layout
from gspo_ray.preflight.model import PreflightError
from gspo_ray.trainer.layout_plan import USABLE_SHARE, fitting_layouts, step_seconds
from gspo_ray.trainer.memory import GIB, Layout, MemoryShape, MemoryTerms, rank_memory


@dataclass
class MemoryPlan:
    shape: MemoryShape
    layout: Layout
    terms: MemoryTerms
    device_bytes: int | None      # what one rank must fit (None: unknown)
    device_source: str            # where device_bytes came from
    hard: bool                    # a refusal (GPU or declared) or a warning only (a CPU pool's host memory)
    batch_tokens: int             # tokens a step trains (the step-time estimate)
    attention_pairs: float        # query-key pairs a step's attention computes (the step-time estimate)
    min_tokens: int               # the smallest micro_batch_tokens a layout may have (rollout.max_model_len)
    accepts: Callable[[Layout], bool] | None = None  # whether the job could run at a layout (job_layout_check)

    def fitting(self, limit: int = 5):
        """The cheapest `limit` layouts of as many ranks that fit the device and that the job could run at
        (trainer/layout_plan.fitting_layouts, `accepts`)."""
        return fitting_layouts(self.shape, self.layout, self.layout.world, self.device_bytes, self.batch_tokens,
                               limit, self.min_tokens, self.attention_pairs, accepts=self.accepts)

    def step_s(self, layout: Layout | None = None) -> float:
        return step_seconds(self.shape, layout or self.layout, self.batch_tokens, self.attention_pairs)

    @property
    def fits(self) -> bool:
        return self.device_bytes is None or self.terms.total <= USABLE_SHARE * self.device_bytes


def job_dtype(cfg: JobConfig) -> str:
    """trainer.dtype with auto read as bfloat16 on a GPU pool (what auto resolves to on CUDA), float32 on CPU."""
    if cfg.trainer.dtype != "auto":
        return cfg.trainer.dtype
    return "bfloat16" if cfg.trainer.num_gpus_per_worker > 0 else "float32"


def job_layout(cfg: JobConfig, world: int | None = None) -> Layout:
    t, r = cfg.trainer, cfg.rollout
    tokens = t.micro_batch_tokens or t.micro_batch_size * r.max_model_len
    return Layout(world=world or t.num_workers, tp=t.tp, ep=t.ep, cp=t.cp, pp=t.pp, micro_batch_tokens=tokens,
                  recompute=t.recompute, recompute_layers=t.recompute_num_layers, dtype=job_dtype(cfg),
                  distributed_optimizer=t.use_distributed_optimizer, offload=t.optimizer_cpu_offload,
                  grads_fp32=t.grad_reduce_in_fp32)


def job_layout_check(cfg: JobConfig, hf_config: dict, where: str = "config.json") -> Callable[[Layout], bool]:
    """Whether the job could run at a layout: its trainer section with the layout's fields (ranks, TP, EP, CP, PP,
    recompute, micro_batch_tokens, offload, gradient buffers) passes TrainerConfig's validators and the preflight's
    model checks (job_model.check_trainer_layout: the converter's TP x EP, CP against the model, PP dividing the
    layers and the features PP does not build). Answers are cached by those fields."""
    answers: dict[tuple, bool] = {}
    base = cfg.trainer.model_dump()

    def accepts(layout: Layout) -> bool:
        fields = dict(num_workers=layout.world, tp=layout.tp, ep=layout.ep, cp=layout.cp, pp=layout.pp,
                      recompute=layout.recompute, micro_batch_tokens=layout.micro_batch_tokens,
                      optimizer_cpu_offload=layout.offload, grad_reduce_in_fp32=layout.grads_fp32,
                      use_distributed_optimizer=layout.distributed_optimizer)
        if layout.recompute != "selective":  # read with selective only: another recompute drops it
            fields["recompute_modules"] = None
        key = tuple(sorted((k, str(v)) for k, v in fields.items()))
        if key not in answers:
            try:
                trainer = TrainerConfig(**(base | fields))
                check_trainer_layout(cfg.model_copy(update={"trainer": trainer}), where, hf_config)
                answers[key] = True
            except (ValidationError, PreflightError):
                answers[key] = False
        return answers[key]

    return accepts


def device_memory(cfg: JobConfig) -> tuple[int | None, str, bool]:
    """(bytes one trainer rank may use, where that came from, whether a miss is a refusal)."""
    t = cfg.trainer
    if t.device_memory_gb is not None:
        return int(t.device_memory_gb * GIB), f"trainer.device_memory_gb {t.device_memory_gb:g}", True
    if t.num_gpus_per_worker > 0:
        try:
            import torch

            if torch.cuda.is_available():
                total = torch.cuda.get_device_properties(0).total_memory
                return total, f"GPU 0's {total / GIB:.1f} GiB (detected)", True
        except (ImportError, RuntimeError):
            pass
        return None, "no GPU here to read; set trainer.device_memory_gb", False
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // t.num_workers, (f"this host's {host / GIB:.1f} GiB shared by {t.num_workers} CPU rank(s)"), False


def job_memory_plan(cfg: JobConfig, hf_config: dict, world: int | None = None,
                    device_gib: float | None = None) -> MemoryPlan:
    """The job's memory plan (see the module docstring); `world` / `device_gib` stand in for the job's rank count
    and device (gspo-ray plan --gpus / --gpu-memory)."""
    shape = MemoryShape.from_hf_config(hf_config, name=str(hf_config.get("model_type")))
    layout = job_layout(cfg, world)
    device, source, hard = device_memory(cfg)
    if device_gib is not None:
        device, source, hard = int(device_gib * GIB), f"--gpu-memory {device_gib:g}", True
    if device is not None and gpu_colocated(cfg.rollout.num_gpus_per_worker, cfg.trainer.num_gpus_per_worker):
        share = resolve_gpu_memory_utilization(cfg.rollout.gpu_memory_utilization, cfg.rollout.num_gpus_per_worker,
                                               cfg.trainer.num_gpus_per_worker)
        layout = Layout(**{**layout.__dict__, "engine_bytes": int(share * device)})
    r = cfg.rollout  # a step at full length: prompts x completions of max_model_len (an upper bound), each
    # completion attending to its prompt and itself (prompt max_model_len - max_new_tokens)
    rows = cfg.coordinator.prompts_per_step * r.group_size
    prompt, new = max(r.max_model_len - r.max_new_tokens, 0), r.max_new_tokens
    pairs = cfg.coordinator.prompts_per_step * prompt * (prompt + 1) / 2 + rows * new * (prompt + (new + 1) / 2)
    return MemoryPlan(shape, layout, rank_memory(shape, layout), device, source, hard, rows * r.max_model_len,
                      pairs, r.max_model_len, accepts=job_layout_check(cfg, hf_config))


def refusal_line(plan: MemoryPlan) -> str:
    """One line: per-rank GiB, the largest term, the cheapest layout that fits (or that none does)."""
    name, size = plan.terms.largest()
    head = (f"trainer memory: {plan.terms.total / GIB:.1f} GiB a rank ({plan.layout.describe()}) does not fit "
            f"{USABLE_SHARE:.0%} of {plan.device_bytes / GIB:.1f} GiB ({plan.device_source}); largest term {name} "
            f"{size / GIB:.1f} GiB")
    fits = plan.fitting(1)
    if fits:
        layout, terms = fits[0]
        return head + f"; fits: {layout.describe()} ({terms.total / GIB:.1f} GiB; gspo-ray plan lists more)"
    return head + (f"; no TP / EP / CP / PP / recompute / micro_batch_tokens / offload / gradient buffer layout of "
                   f"{plan.layout.world} ranks fits: more ranks")


def check_memory(cfg: JobConfig, hf_config: dict | None, report) -> MemoryPlan | None:
    """The preflight's memory line, or a PreflightError when the plan does not fit a GPU (or declared) device."""
    if hf_config is None:
        return None
    try:
        plan = job_memory_plan(cfg, hf_config)
    except (ValueError, KeyError, TypeError) as e:  # the converter check reports a config it cannot build
        report.add("memory", "skipped", str(e))
        return None
    if plan.device_bytes is None:
        report.add("memory", "warning", f"{plan.terms.total / GIB:.1f} GiB a trainer rank; {plan.device_source}")
    elif not plan.fits and plan.hard:
        raise PreflightError(refusal_line(plan))
    elif not plan.fits:
        report.add("memory", "warning", refusal_line(plan))
    else:
        report.add("memory", "ok", f"{plan.terms.total / GIB:.1f} GiB a trainer rank of {plan.device_bytes / GIB:.1f} "
                                   f"({plan.device_source}); largest term {plan.terms.largest()[0]}")
    return plan
