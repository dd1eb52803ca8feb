"""Where a job's prompts come from: a built-in generated task, or files (JSONL, parquet, a save_to_disk dataset)."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from gspo_ray.config.base import Strict

FILE_SOURCES = ("jsonl", "parquet", "hf_disk")


def missing_path_message(path: Path | str) -> str:
    """The one line for a data path that does not exist: what was given and the absolute path tried."""
    return (f"file not found: {path} (relative paths resolve against the current directory; tried "
            f"{Path(path).absolute()})")


class DataConfig(Strict):
    """Where prompts come from: a built-in task generator, or files in the verl / TRL layouts (docs/data.md)."""

    source: Literal["builtin", "jsonl", "parquet", "hf_disk"] = Field(
        "builtin", description="prompt source kind: builtin (a generated task), jsonl, parquet (verl / slime "
        "files), hf_disk (a `datasets` save_to_disk directory, TRL)")
    task: Literal["copy", "add", "repeat", "sum", "sort", "guess"] = Field(
        "copy", description="built-in task (source=builtin, gspo_ray/data/tasks.py): copy and add for the tiny "
        "models' tokenizer; repeat, sum (addition in words) and sort (digit sorting) for real models with a chat "
        "template; guess is multi-turn and needs rollout.multi_turn")
    min_digits: int = Field(3, ge=1, description="shortest operand of the built-in task")
    max_digits: int = Field(4, ge=1, description="longest operand of the built-in task")
    guess_low: int = Field(0, ge=0, description="smallest secret of the guess task")
    guess_high: int = Field(9, ge=0, description="largest secret of the guess task")
    path: Path | None = Field(None, description="training data (file sources): a file, or a directory of "
                              "*.jsonl / *.parquet shards, or a save_to_disk directory (hf_disk); relative to the "
                              "current directory")
    eval_path: Path | None = Field(None, description="held-out data for evaluation, in the same layout as path")
    prompt_field: str = Field("prompt", description="field holding the prompt (text, or chat messages); a dotted "
                              "path reaches into nested fields")
    reference_field: str = Field("reference", description="field holding the reference answer; a dotted path "
                                 "reaches into nested fields (verl: reward_model.ground_truth)")
    system_prompt: str | None = Field(None, description="a system message put before each prompt's messages "
                                      "(a row that has its own system message keeps it); needs apply_chat_template")
    apply_chat_template: bool = Field(False, description="wrap prompts with the tokenizer's chat template")
    reference_check_timeout_s: float = Field(
        10.0, gt=0, description="the preflight's limit on the reward's check of one reference (math_verify_reward: "
        "math-verify parses it); a reference past it is reported like an unparsable one, naming its row")
    num_train: int = Field(10_000, ge=1, description="training prompts of the built-in task (source=builtin)")
    num_eval: int = Field(64, ge=0, description="held-out prompts scored at each evaluation")
    seed: int = Field(0, description="prompt order / generator seed")

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        if self.source in FILE_SOURCES and self.path is None:
            raise ValueError(f"data.path is required when data.source is {self.source!r}")
        if self.min_digits > self.max_digits:
            raise ValueError(f"data.min_digits ({self.min_digits}) > data.max_digits ({self.max_digits})")
        if self.guess_low > self.guess_high:
            raise ValueError(f"data.guess_low ({self.guess_low}) > data.guess_high ({self.guess_high})")
        if self.system_prompt is not None and not self.apply_chat_template:
            raise ValueError("data.system_prompt needs data.apply_chat_template: true (a system message is "
                             "rendered by the tokenizer's chat template)")
        return self
