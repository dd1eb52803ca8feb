"""Prompt sources: a built-in task generator or files (JSONL, parquet, a save_to_disk dataset: `sources`),
tokenised once, iterated forever in seeded epochs.

    source = PromptSource.from_jsonl("data/train.jsonl", "runs/models/tiny-moe", prompt_field="question",
                                     reference_field="answer", max_prompt_tokens=512)
    source = PromptSource.from_files("data/train.parquet", tok, source="parquet", apply_chat_template=True,
                                     reference_field="reward_model.ground_truth", system_prompt="Think first.")
    source.validate()          # reads and tokenises every row now; errors name file:line and the field
    batch = source.take(16)    # list[Prompt]; uids "train-<row>-e<epoch>", unique within a job
    held_out = PromptSource.from_task("copy", tokenizer, split="eval", num_eval=64).prompts()
    guesses = PromptSource.from_task("guess", tokenizer, guess_low=0, guess_high=9)   # "0-9:", reference "7"

Every problem with the data is found before any actor or engine starts: a missing file (named), a row without
the configured field (file:line and field), a prompt that is empty or too long for `max_prompt_tokens` or for
`max_model_len - max_new_tokens` after the chat template (file:line and its token count): one line per row. Token ids are made here, once: nothing
downstream re-tokenises. No special tokens are added, unless the tokenizer's chat template is requested.
"""
from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any, Iterator

from gspo_ray.data.records import Prompt
from gspo_ray.data.sources import DataRowsError, PromptRow, read_rows
from gspo_ray.data.tasks import build_task_splits

SPLITS = ("train", "eval")


def load_tokenizer(tokenizer: Any) -> Any:
    """An HF tokenizer object as is, or loaded from a model directory / name (local files only)."""
    if not isinstance(tokenizer, (str, Path)):
        return tokenizer
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer))
    except Exception as e:
        raise ValueError(f"cannot load a tokenizer from {str(tokenizer)!r}: {type(e).__name__}: {e}") from e


def task_rows(task: str, split: str, num_train: int = 10_000, num_eval: int = 64, seed: int = 0,
              min_digits: int = 1, max_digits: int = 4, *, guess_low: int = 0, guess_high: int = 9
              ) -> list[PromptRow]:
    """Rows of a built-in task's train or held-out split (`gspo_ray.data.tasks`); guess_* only for "guess"."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    train, held_out = build_task_splits(task, num_train, num_eval, seed, min_digits, max_digits,
                                        guess_low=guess_low, guess_high=guess_high)
    examples = train if split == "train" else held_out
    return [PromptRow(e.prompt, e.reference, f"builtin:{task}/{split}#{i}") for i, e in enumerate(examples)]


class PromptSource:
    """Tokenised prompts of one split, iterated forever: each epoch is a fresh seeded shuffle (train) or the rows
    in order (eval). `take(n)` and `iter()` share one cursor; `state_dict()` makes the order resumable."""

    def __init__(self, rows: list[PromptRow], tokenizer: Any, *, split: str = "train", seed: int = 0,
                 shuffle: bool | None = None, max_prompt_tokens: int | None = None,
                 max_new_tokens: int | None = None, max_model_len: int | None = None,
                 apply_chat_template: bool = False, system_prompt: str | None = None, name: str = "prompts"):
        if not rows:
            raise ValueError(f"{name}: no prompts")
        self.rows, self.split, self.seed, self.name = rows, split, seed, name
        self.shuffle = split == "train" if shuffle is None else shuffle
        self.tokenizer = load_tokenizer(tokenizer)
        self.max_prompt_tokens = max_prompt_tokens
        self.max_new_tokens, self.max_model_len = max_new_tokens, max_model_len  # prompt room = len - new
        self.apply_chat_template, self.system_prompt = apply_chat_template, system_prompt
        self._ids: list[list[int]] | None = None
        self._texts: list[str] | None = None
        self._epoch, self._pos = 0, 0
        self._order: list[int] | None = None

    @classmethod
    def from_jsonl(cls, path: str | Path, tokenizer: Any, *, prompt_field: str = "prompt",
                   reference_field: str | None = "reference", split: str = "train", **kwargs: Any) -> PromptSource:
        return cls.from_files(path, tokenizer, source="jsonl", prompt_field=prompt_field,
                              reference_field=reference_field, split=split, **kwargs)

    @classmethod
    def from_files(cls, path: str | Path, tokenizer: Any, *, source: str = "jsonl", prompt_field: str = "prompt",
                   reference_field: str | None = "reference", split: str = "train", **kwargs: Any) -> PromptSource:
        """Rows of a JSONL / parquet file or directory, or a save_to_disk directory (source hf_disk)."""
        rows = read_rows(path, source, prompt_field, reference_field, kwargs.get("apply_chat_template", False))
        return cls(rows, tokenizer, split=split, name=str(path), **kwargs)

    @classmethod
    def from_task(cls, task: str, tokenizer: Any, *, split: str = "train", num_train: int = 10_000,
                  num_eval: int = 64, seed: int = 0, min_digits: int = 1, max_digits: int = 4,
                  guess_low: int = 0, guess_high: int = 9, **kwargs: Any) -> PromptSource:
        rows = task_rows(task, split, num_train, num_eval, seed, min_digits, max_digits, guess_low=guess_low,
                         guess_high=guess_high)
        return cls(rows, tokenizer, split=split, seed=seed, name=f"builtin:{task}/{split}", **kwargs)

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any, split: str = "train", **kwargs: Any) -> PromptSource | None:
        """From a `DataConfig`; None for an eval split that has no data (no eval_path, or num_eval == 0).
        `kwargs` carries the limits that live in other sub-configs (max_new_tokens, max_model_len, ...)."""
        num_train = kwargs.pop("num_train", None) or getattr(cfg, "num_train", None) or 10_000
        common = dict(apply_chat_template=cfg.apply_chat_template, system_prompt=cfg.system_prompt, **kwargs)
        if cfg.source == "builtin":
            if split == "eval" and not cfg.num_eval:
                return None
            return cls.from_task(cfg.task, tokenizer, split=split, num_train=num_train, num_eval=cfg.num_eval,
                                 seed=cfg.seed, min_digits=cfg.min_digits, max_digits=cfg.max_digits,
                                 guess_low=cfg.guess_low, guess_high=cfg.guess_high, **common)
        path = cfg.path if split == "train" else cfg.eval_path
        if path is None:
            if split == "train":
                raise ValueError(f"data.path is required when data.source is {cfg.source!r}")
            return None
        return cls.from_files(path, tokenizer, source=cfg.source, prompt_field=cfg.prompt_field,
                              reference_field=cfg.reference_field, split=split, seed=cfg.seed, **common)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def epoch(self) -> int:
        return self._epoch

    def validate(self) -> PromptSource:
        """Tokenise every row (once; cached) and check lengths. Raises naming the rows; returns self."""
        if self._ids is None:
            texts = [self._render(r) for r in self.rows]
            ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
            self._check_lengths(ids)
            if not self.apply_chat_template:
                self._check_round_trip(texts, ids)
            self._texts, self._ids = texts, [list(x) for x in ids]
        return self

    def _render(self, row: PromptRow) -> str:
        if not self.apply_chat_template:
            return row.prompt
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.name}: data.apply_chat_template is true but the tokenizer "
                             f"({getattr(self.tokenizer, 'name_or_path', '?')}) has no chat template")
        messages = row.prompt if isinstance(row.prompt, list) else [{"role": "user", "content": row.prompt}]
        if self.system_prompt is not None and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        # Render to text, then encode without adding specials: the template already writes them out.
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def _length_limit(self) -> tuple[int | None, str]:
        limits = []
        if self.max_prompt_tokens is not None:
            limits.append((self.max_prompt_tokens, f"max_prompt_tokens={self.max_prompt_tokens}"))
        if self.max_model_len is not None and self.max_new_tokens is not None:
            room = self.max_model_len - self.max_new_tokens
            limits.append((room, f"rollout.max_model_len={self.max_model_len} - "
                                 f"rollout.max_new_tokens={self.max_new_tokens} = {room}"))
        return min(limits) if limits else (None, "")

    def _check_lengths(self, ids: list[list[int]]) -> None:
        """Every prompt has 1..limit tokens, as rendered (chat template included); one line per row that has not."""
        limit, why = self._length_limit()
        template = " after the chat template" if self.apply_chat_template else ""
        problems = [f"{r.origin}: prompt has {len(x)} tokens{template}, out of bounds: "
                    + ("it must not be empty" if not x else f"at most {limit} tokens fit ({why})")
                    for r, x in zip(self.rows, ids) if not x or (limit is not None and len(x) > limit)]
        if problems:
            raise DataRowsError(problems)

    def _check_round_trip(self, texts: list[str], ids: list[list[int]]) -> None:
        """Warn when text is lost in tokenisation (characters outside the vocabulary are silently dropped by
        tokenizers without an unknown token, e.g. the tiny character-level one)."""
        for row, text, x in zip(self.rows, texts, ids):
            back = self.tokenizer.decode(x, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if back.strip() != text.strip():
                warnings.warn(f"{row.origin}: prompt {text[:60]!r} tokenises to ids that decode to {back[:60]!r}; "
                              "characters outside the tokenizer's vocabulary are lost", stacklevel=3)
                return  # one warning is enough to point at the problem

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(f"gspo_ray.prompts:{self.seed}:{self.split}:{self._epoch}").shuffle(order)
            self._order = order
        return self._order

    def _make(self, index: int, epoch: int) -> Prompt:
        row = self.rows[index]
        return Prompt(uid=f"{self.split}-{index}-e{epoch}", prompt_ids=list(self._ids[index]), reference=row.reference,
                      text=self._texts[index], meta={"origin": row.origin, "split": self.split, "index": index,
                                                     "epoch": epoch, "fields": dict(row.fields)})

    def __iter__(self) -> Iterator[Prompt]:
        """Endless: next prompt of this epoch; after the last one, the next epoch starts (reshuffled)."""
        self.validate()
        while True:
            order = self._epoch_order()
            if self._pos == len(order):
                self._epoch, self._pos, self._order = self._epoch + 1, 0, None
                continue
            self._pos += 1
            yield self._make(order[self._pos - 1], self._epoch)

    def take(self, n: int) -> list[Prompt]:
        """The next n prompts (crossing epoch boundaries as needed)."""
        it = iter(self)
        return [next(it) for _ in range(n)]

    def prompts(self) -> list[Prompt]:
        """Every row once, in row order, as epoch 0 (for held-out evaluation); does not move the cursor."""
        self.validate()
        return [self._make(i, 0) for i in range(len(self.rows))]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "position": self._pos, "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("num_rows", len(self.rows)) != len(self.rows):
            raise ValueError(f"{self.name}: checkpoint was taken with {state['num_rows']} prompts, "
                             f"the source now has {len(self.rows)}")
        self._epoch, self._pos, self._order = int(state["epoch"]), int(state["position"]), None
