"""What every config section shares: strict models, the error type, and the constants several sections read."""
from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict

ImportanceLevel = Literal["token", "sequence", "sequence_token"]
Aggregation = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # JobConfig.name: one directory under out_dir
GUESS_ENV = "gspo_ray.envs.guess:GuessNumberEnv"  # the environment of the built-in guess task

# Clip ranges (eps_low, eps_high) by importance-sampling level: GSPO paper §5.1 for the sequence levels; the
# paper's GRPO baseline for tokens (0.2/0.27; DAPO's clip-higher uses 0.2/0.28).
DEFAULT_CLIP = {"sequence": (3e-4, 4e-4), "sequence_token": (3e-4, 4e-4), "token": (0.2, 0.27)}


class Strict(BaseModel):
    """A config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ConfigError(ValueError):
    """A job file that cannot run; the message names the file and the field. `problems` holds one
    (field, message) pair per invalid field when the file parsed but did not validate."""

    def __init__(self, message: str, where: str = "", problems: list[tuple[str, str]] | None = None,
                 sources: list[str] | None = None):
        super().__init__(message)
        self.where, self.problems = where, list(problems or [])
        self.sources = list(sources or [where] * len(self.problems))  # per problem: the file or the override

    def lines(self) -> list[str]:
        """One self-contained line per problem: `file: field: what is wrong (what would be valid)`, or
        `command-line override 'k=v': field: ...` when an override set it."""
        if not self.problems:
            return [" ".join(str(self).split())]
        return [f"{src}: {msg}" if loc == "(job)" else f"{src}: {loc}: {msg}"
                for src, (loc, msg) in zip(self.sources, self.problems)]
