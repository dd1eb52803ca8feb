"""Megatron DDP wrapping, AdamW and the learning-rate schedule of a trainer worker.

    ddp = build_ddp(model, dtype="float32", use_distributed_optimizer=False)
    optimizer = build_optimizer(ddp, cfg)           # cfg: gspo_ray.config.TrainerConfig
    scheduler = build_scheduler(optimizer, cfg)
    ...  forward / backward over micro-batches ...
    grad_norm, lr, ok = optimizer_step(ddp, optimizer, scheduler, loss_finite)   # ok False: skipped (NaN/inf)

Megatron's DDP + `finalize_model_grads` is used (not torch.optim with a hand all-reduce, which sums different
experts' gradients under EP). DDP *averages* gradients over the data-parallel group (dense params: 1/dp; expert
params: 1/dp as well, over the expert-data-parallel group, whose sum already includes every DP rank's tokens through
the all-to-all); the caller scales its loss by dp so the step is that of the summed mini-batch loss. Under context
parallelism (trainer.cp) both reductions run over DP x CP ranks and divide by dp x cp: the caller scales by dp x cp
(worker.py, "Loss scaling").

LR schedule: the scheduler is advanced *before* each optimizer step, so optimizer step k (1-based) runs at
`lr * k / lr_warmup_steps` during warm-up (no wasted lr=0 step), then `lr` (constant) or a cosine from `lr` at the
end of warm-up to `min_lr` at `total_steps`.
"""
from __future__ import annotations

import torch
from gspo_ray.compat.megatron_import import megatron_core  # noqa: F401  (first: megatron without torch.compile)
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from gspo_ray.compat.megatron_cpu import cpu_device_mode
from gspo_ray.trainer.model_spec import DTYPES


def torch_dtype(name: str) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' -> torch dtype (ValueError naming the valid ones otherwise)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown trainer dtype {name!r}; valid: {', '.join(DTYPES)}") from None


def mark_parallel_params(model: torch.nn.Module) -> dict[str, int]:
    """Restore the parameter attributes Megatron's DDP and optimizer rely on; returns how many were fixed.

    1. `tensor_model_parallel` / `partition_dim` on TP-split weights. Megatron sets them only inside its random
       init, which is skipped when weights are loaded (`perform_initialization=False`). Without them the grad norm
       counts TP-split weights on TP rank 0 only (too small), and expert weights on TP rank 0 only while their norm
       is reduced over a group without the other TP ranks: TP ranks then clip by different norms and diverge.
    2. `allreduce=False` on expert weights when EP is 1 but the experts' data-parallel group is larger than the
       dense one (TP > 1 with expert-TP 1): megatron-core 0.16.1 marks experts as expert-parallel only when
       EP > 1, so DDP would reduce their grads over the dense DP group and miss the other TP ranks' token shards.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    fixed = {"tensor_model_parallel": 0, "allreduce": 0}
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        for module in model.modules():
            dim = {ColumnParallelLinear: 0, RowParallelLinear: 1, VocabParallelEmbedding: 0}.get(type(module))
            weight = getattr(module, "weight", None)
            if dim is not None and weight is not None and not hasattr(weight, "tensor_model_parallel"):
                set_tensor_model_parallel_attributes(weight, True, dim, 1)
                fixed["tensor_model_parallel"] += 1
    expert_dp = parallel_state.get_expert_data_parallel_world_size()
    # dense grads are reduced over DP x CP (Megatron's dp_cp group): the experts' group differs from that one
    if expert_dp != parallel_state.get_data_parallel_world_size(with_context_parallel=True):
        for name, param in model.named_parameters():
            if ".experts." in name and getattr(param, "allreduce", True):
                param.allreduce = False
                fixed["allreduce"] += 1
    return fixed


def build_ddp(model: torch.nn.Module, *, dtype: str = "float32", use_distributed_optimizer: bool = False,
              grad_reduce_in_fp32: bool = True):
    """Wrap a Megatron GPTModel in Megatron's DistributedDataParallel (grads reduced in finalize, not overlapped).
    grad_reduce_in_fp32 (trainer.grad_reduce_in_fp32): in a bf16 model the gradient buffer is fp32 (true) or bf16;
    an fp32 model's buffer is fp32 either way."""
    mark_parallel_params(model)
    ddp_config = DistributedDataParallelConfig(
        # low-precision training accumulates and reduces grads in fp32 (micro-batch sums stay exact enough)
        grad_reduce_in_fp32=torch_dtype(dtype) != torch.float32 and grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        check_for_nan_in_grad=False,  # it raises; `grads_finite` skips the step instead
    )
    with cpu_device_mode():
        return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def build_optimizer_config(cfg) -> OptimizerConfig:
    """TrainerConfig -> Megatron OptimizerConfig (AdamW with decoupled weight decay, global-norm clipping)."""
    dtype = torch_dtype(cfg.dtype)
    return OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=min(cfg.min_lr, cfg.lr),
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.grad_clip,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=cfg.distributed_optimizer,
        decoupled_weight_decay=True,
        **offload_options(cfg),
    )


def offload_options(cfg) -> dict:
    """trainer.optimizer_cpu_offload -> OptimizerConfig keywords: Megatron's HybridDeviceOptimizer with every state
    tensor on the CPU (offload fraction 1; its default 0 offloads nothing) and the step computed there (CPU Adam),
    under the distributed optimizer (the config turns it on). CUDA only: the config refuses it on a CPU pool, and
    this refuses it on a machine without CUDA. Not yet run on a GPU."""
    if not getattr(cfg, "optimizer_cpu_offload", False):
        return {}
    if not torch.cuda.is_available():
        raise ValueError("trainer.optimizer_cpu_offload needs CUDA: on a CPU the optimizer state is in host memory "
                         "already")
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)


def build_optimizer(ddp_model, cfg):
    """Megatron optimizer over a DDP-wrapped model: a ChainedOptimizer (dense params, expert params)."""
    with cpu_device_mode():
        return get_megatron_optimizer(build_optimizer_config(cfg), [ddp_model])


def build_scheduler(optimizer, cfg) -> OptimizerParamScheduler:
    """Linear warm-up from 0, then constant or cosine decay to `min_lr` at `total_steps`."""
    warmup = cfg.lr_warmup_steps
    if cfg.lr_schedule == "cosine":
        if cfg.total_steps is None or cfg.total_steps <= warmup:
            raise ValueError(f"trainer.lr_schedule='cosine' needs trainer.total_steps > trainer.lr_warmup_steps "
                             f"({warmup}), got {cfg.total_steps}")
        decay_steps, style = cfg.total_steps, "cosine"
    elif cfg.lr_schedule == "constant":
        decay_steps, style = warmup + 1, "constant"
    else:
        raise ValueError(f"unknown trainer.lr_schedule {cfg.lr_schedule!r}; valid: constant, cosine")
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else cfg.lr,
        max_lr=cfg.lr,
        min_lr=min(cfg.min_lr, cfg.lr),
        lr_warmup_steps=warmup,
        lr_decay_steps=decay_steps,
        lr_decay_style=style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )


def zero_grads(ddp_model, optimizer) -> None:
    """Clear DDP's gradient buffers and the optimizer's main grads before a new accumulation."""
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()


class NonFiniteStepsError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient (trainer.max_skipped_steps)."""


def all_finite(t: torch.Tensor) -> bool:
    """Every element of `t` is finite. Exact, and one read of `t` in the common case: a sum is non-finite when
    an element is (NaN propagates; inf + finite = inf; inf + -inf = NaN) or when finite elements overflow it; only
    then is every element looked at. (The element-wise check costs ~25x the sum: on SmolLM2's 134.5M-element
    gradient buffer, 660 ms against 28 ms here: it allocates and writes two full-size temporaries.)"""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def grads_finite(ddp_model, loss_finite: bool = True) -> bool:
    """True when this rank's loss and every rank's reduced gradients are finite (collective: all ranks agree).

    Megatron's own guard does not fire here: its fp32 and bf16 optimizers report no inf (only fp16's loss scaler
    checks), and DDP's `check_for_nan_in_grad` raises instead of skipping. One `all_finite` per gradient buffer.
    """
    import torch.distributed as dist

    buffers = getattr(ddp_model, "buffers", []) + getattr(ddp_model, "expert_parallel_buffers", [])
    grads = [b.grad_data for b in buffers] or [p.main_grad for p in ddp_model.parameters()
                                                if getattr(p, "main_grad", None) is not None]
    ok = loss_finite and all(all_finite(g) for g in grads)
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([0.0 if ok else 1.0], device=grads[0].device if grads else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # one bad rank (e.g. its own experts) skips everyone's step
        ok = float(flag) == 0.0
    return ok


def optimizer_step(ddp_model, optimizer, scheduler, loss_finite: bool = True) -> tuple[float, float, bool]:
    """Reduce grads (DP all-reduce, TP/SP norm grads), check them, advance the schedule, step.
    Returns (grad_norm, lr, ok).

    ok is False when the step was skipped (non-finite loss or gradient on any rank, or the optimizer's own skip):
    weights, optimizer state and the LR schedule are untouched and the caller must not bump the version.
    """
    with cpu_device_mode():
        finalize_model_grads([ddp_model])
        if not grads_finite(ddp_model, loss_finite):
            return float("nan"), float(optimizer.param_groups[0]["lr"]), False
        scheduler.step(1)
        lr = float(optimizer.param_groups[0]["lr"])
        ok, grad_norm, _ = optimizer.step()
    return float(grad_norm) if grad_norm is not None else float("nan"), lr, bool(ok)


class SkippedSteps:
    """Counts skipped (non-finite) steps; raises NonFiniteStepsError at `max_in_a_row` consecutive ones."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.total = 0
        self.in_a_row = 0

    def record(self, ok: bool, version: int) -> None:
        if ok:
            self.in_a_row = 0
            return
        self.total += 1
        self.in_a_row += 1
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteStepsError(
                f"{self.in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                f"(trainer.max_skipped_steps={self.max_in_a_row}); weights kept at policy version {version}. "
                "Check rewards and advantages for NaN/inf, or lower trainer.lr")


def sub_optimizers(optimizer) -> list:
    """The Megatron optimizers inside a ChainedOptimizer (dense, expert), or [optimizer] itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))
