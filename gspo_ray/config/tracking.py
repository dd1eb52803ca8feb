"""Where a job writes: the run directory, metrics sinks (TensorBoard, W&B), exports."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from gspo_ray.config.base import Strict


class WandbConfig(Strict):
    """Weights & Biases metrics sink (optional extra: `pip install 'gspo-ray[wandb]'`). Offline mode needs no
    network: `wandb sync runs/NAME/wandb/offline-run-*` uploads later."""

    project: str = Field("gspo-ray", description="W&B project")
    mode: Literal["offline", "online", "disabled"] = Field("offline", description="offline writes under "
                                                           "run_dir/wandb only; online streams to the W&B server")
    entity: str | None = Field(None, description="W&B entity (team or user); None = the account's default")
    group: str | None = Field(None, description="W&B run group (e.g. one sweep)")
    tags: list[str] = Field(default_factory=list, description="W&B run tags")

    @model_validator(mode="after")
    def _installed(self) -> "WandbConfig":
        import importlib.util

        if self.mode != "disabled" and importlib.util.find_spec("wandb") is None:
            raise ValueError("selected, but the wandb package is not installed: pip install 'gspo-ray[wandb]', "
                             "or set logging.wandb.mode: disabled")
        return self


class LoggingConfig(Strict):
    """Where results go."""

    out_dir: Path = Field(Path("runs"), description="run directories are created under this")
    tensorboard: bool = Field(True, description="write TensorBoard event files")
    plot: bool = Field(True, description="write a PNG of reward / clip fraction / churn / mismatch at the end")
    progress: bool = Field(True, description="show a live progress bar")
    save_rollouts: bool = Field(False, description="write each step's trained samples to rollouts/step_N.jsonl")
    export_hf: Literal["none", "final", "every_checkpoint"] = Field(
        "final", description="HF model directories (safetensors + config + tokenizer): final = run_dir/hf from the "
        "last checkpoint at the end; every_checkpoint = also checkpoints/step_N/hf next to each checkpoint")
    export_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="dtype of exported HF weights (None = the training dtype)")
    wandb: WandbConfig | None = Field(None, description="Weights & Biases sink (None = off)")
