"""Calculator tool use: a multi-turn environment the tiny char-level tokenizer can express.

    rollout:
      multi_turn: {env: "gspo_ray.envs.calculator:CalculatorEnv", kwargs: {max_calls: 2}, max_turns: 3}
    prompts = PromptSource.from_task("add", tokenizer).take(16)       # "12+34=" with reference "46"

A transcript (`|` separates the pieces; it is not a token):  12+34= | c12+34<eos> | =46 | 46<eos>
- prompt: an arithmetic question ending in "=" (the built-in `add` task). The answer is the prompt's
  `reference`, else the value of the prompt's expression.
- action, tool call: "c" + expression (digits and + - *, usual precedence) + EOS. Observation: "=" + value,
  e.g. "=46"; a malformed call (bad expression, no EOS) gets "*". After `max_calls` calls the next call ends the
  episode unanswered (reward 0).
- action, answer: anything else, read as the final answer: digits (a leading "-" allowed) + EOS. Correct ->
  `correct_reward`, else 0. The episode ends; no observation follows.
- optional shaping: `call_reward` for each well-formed tool call (default 0: only the answer counts).
No `eval`: expressions are parsed here, operands at most 6 digits, results bounded.
"""
from __future__ import annotations

import re
from typing import Any

from gspo_ray.data.prompts import load_tokenizer
from gspo_ray.data.records import Prompt
from gspo_ray.envs.multiturn import StepResult, encode_text

TOOL, RESULT, INVALID = "c", "=", "*"
_NUMBER = re.compile(r"\d{1,6}")
_ANSWER = re.compile(r"-?\d+")
_MAX_ABS = 10 ** 12


def compute_expression(expr: str) -> int | None:
    """Value of `expr` = number (op number)*, op in + - *, '*' binding tighter, an optional leading '-';
    None when malformed or out of bounds (|value| >= 1e12)."""
    sign = 1
    if expr.startswith("-"):
        sign, expr = -1, expr[1:]
    tokens = re.split(r"([+\-*])", expr)  # numbers at even positions, operators at odd ones
    numbers, ops = tokens[0::2], tokens[1::2]
    if not all(_NUMBER.fullmatch(n) for n in numbers):
        return None
    total, term = 0, sign * int(numbers[0])
    for op, num in zip(ops, numbers[1:]):
        if op == "*":
            term *= int(num)
        else:
            total += term
            term = int(num) if op == "+" else -int(num)
        if abs(term) >= _MAX_ABS:
            return None
    total += term
    return total if abs(total) < _MAX_ABS else None


class CalculatorEnv:
    """An arithmetic question; the model may call a calculator tool before answering (see module doc)."""

    replayable = True  # reset and step depend only on (prompt, seed, actions): partial rollouts may replay it

    def __init__(self, tokenizer: Any, max_calls: int = 2, correct_reward: float = 1.0, call_reward: float = 0.0):
        self.tokenizer = load_tokenizer(tokenizer)
        self.eos_id = self.tokenizer.eos_token_id
        self.max_calls, self.correct_reward, self.call_reward = max_calls, correct_reward, call_reward
        self.answer: str | None = None
        self.calls = 0

    def reset(self, prompt: Prompt, seed: int) -> list[int]:
        """Fix the answer from the prompt; the prompt already asks the question, so nothing is appended."""
        if prompt.reference is not None:
            self.answer = str(prompt.reference)
        else:
            text = prompt.text or self.tokenizer.decode(prompt.prompt_ids, skip_special_tokens=True)
            value = compute_expression(text.rstrip().removesuffix("="))
            if value is None:
                raise ValueError(f"calculator env: prompt {text!r} is not an expression ending in '='")
            self.answer = str(value)
        self.calls = 0
        return []

    def step(self, action_ids: list[int], action_text: str) -> StepResult:
        eos_found = bool(action_ids) and action_ids[-1] == self.eos_id
        if action_text.startswith(TOOL):
            return self._tool_call(action_text[len(TOOL):], eos_found)
        correct = eos_found and _ANSWER.fullmatch(action_text) is not None and action_text == self.answer
        return StepResult("", self.correct_reward if correct else 0.0, True,
                          {"correct": float(correct), "calls": self.calls})

    def _tool_call(self, expr: str, eos_found: bool) -> StepResult:
        if self.calls >= self.max_calls:  # out of calls: the episode ends unanswered
            return StepResult("", 0.0, True, {"correct": 0.0, "calls": self.calls, "calls_exceeded": 1.0})
        self.calls += 1
        value = compute_expression(expr) if eos_found else None
        if value is None:
            return StepResult(encode_text(self.tokenizer, INVALID), 0.0, False, {"calls": self.calls})
        obs = encode_text(self.tokenizer, f"{RESULT}{value}")
        return StepResult(obs, self.call_reward, False, {"calls": self.calls})
