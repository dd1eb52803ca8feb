"""Where a job's prompts come from: a JSONL file or a built-in generated task."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from gspo_ray.config.base import Strict


class DataConfig(Strict):
    """Where prompts come from: a built-in task generator or a JSONL file."""

    source: Literal["builtin", "jsonl"] = Field("builtin", description="prompt source kind")
    task: Literal["copy", "add", "repeat", "sum", "sort", "guess"] = Field(
        "copy", description="built-in task (source=builtin, gspo_ray/data/tasks.py): copy and add for the tiny "
        "models' tokenizer; repeat, sum (addition in words) and sort (digit sorting) for real models with a chat "
        "template; guess is multi-turn and needs rollout.multi_turn")
    min_digits: int = Field(3, ge=1, description="shortest operand of the built-in task")
    max_digits: int = Field(4, ge=1, description="longest operand of the built-in task")
    guess_low: int = Field(0, ge=0, description="smallest secret of the guess task")
    guess_high: int = Field(9, ge=0, description="largest secret of the guess task")
    path: Path | None = Field(None, description="training JSONL (source=jsonl)")
    eval_path: Path | None = Field(None, description="held-out JSONL for evaluation (source=jsonl)")
    prompt_field: str = Field("prompt", description="JSONL field holding the prompt text")
    reference_field: str = Field("reference", description="JSONL field holding the reference answer")
    apply_chat_template: bool = Field(False, description="wrap prompts with the tokenizer's chat template")
    num_train: int = Field(10_000, ge=1, description="training prompts of the built-in task (source=builtin)")
    num_eval: int = Field(64, ge=0, description="held-out prompts scored at each evaluation")
    seed: int = Field(0, description="prompt order / generator seed")

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        if self.source == "jsonl" and self.path is None:
            raise ValueError("data.path is required when data.source is 'jsonl'")
        if self.min_digits > self.max_digits:
            raise ValueError(f"data.min_digits ({self.min_digits}) > data.max_digits ({self.max_digits})")
        if self.guess_low > self.guess_high:
            raise ValueError(f"data.guess_low ({self.guess_low}) > data.guess_high ({self.guess_high})")
        return self
