"""Guess-a-number: a multi-turn environment the tiny char-level tokenizer can express.

    rollout:
      multi_turn: {env: "gspo_ray.envs.guess:GuessNumberEnv", kwargs: {low: 0, high: 9}, max_turns: 4}
    prompts = build_guess_prompts(tokenizer, num=64, low=0, high=9, seed=0)     # text "0-9:", reference = secret

A transcript (`|` separates the pieces; it is not a token):  0-9: | 5<eos> | + | 8<eos> | - | 7<eos> | =
- prompt "<low>-<high>:" states the range; the secret is the prompt's `reference` (so all completions of one
  prompt chase the same number), or drawn from the episode seed when the reference is None.
- action: the guess in decimal digits, then EOS (a guess without EOS, non-digits or out of range is invalid).
- observation (one character of the alphabet "0123456789copy:=+-*"; there is no '<' or '>'):
  "+" the secret is higher, "-" the secret is lower, "=" correct (episode done), "*" invalid guess.
- reward per turn: `correct_reward` on the right guess, `wrong_reward` on a wrong one, `invalid_reward` on an
  invalid one. The episode reward is their sum (the runner adds them up).
"""
from __future__ import annotations

import random
from typing import Any

from gspo_ray.data.prompts import load_tokenizer
from gspo_ray.data.records import Prompt
from gspo_ray.envs.multiturn import StepResult, encode_text

HIGHER, LOWER, CORRECT, INVALID = "+", "-", "=", "*"


def parse_guess(action_text: str, eos_found: bool, low: int, high: int) -> int | None:
    """The guessed number, or None when the action is not digits + EOS within [low, high]."""
    if not eos_found or not action_text.isdigit() or len(action_text) > len(str(high)):
        return None
    value = int(action_text)
    return value if low <= value <= high else None


class GuessNumberEnv:
    """Secret number in [low, high]; the model guesses, the env answers higher/lower/correct (see module doc)."""

    replayable = True  # reset and step depend only on (prompt, seed, actions): partial rollouts may replay it

    def __init__(self, tokenizer: Any, low: int = 0, high: int = 9, correct_reward: float = 1.0,
                 wrong_reward: float = 0.0, invalid_reward: float = 0.0):
        if not 0 <= low <= high:
            raise ValueError(f"guess env: need 0 <= low <= high, got low={low}, high={high}")
        self.tokenizer = load_tokenizer(tokenizer)
        self.eos_id = self.tokenizer.eos_token_id
        self.low, self.high = low, high
        self.correct_reward, self.wrong_reward, self.invalid_reward = correct_reward, wrong_reward, invalid_reward
        self.secret: int | None = None
        self.guesses = 0

    def reset(self, prompt: Prompt, seed: int) -> list[int]:
        """Pick the secret (the prompt's reference, else from `seed`); the prompt already says everything."""
        if prompt.reference is not None:
            self.secret = int(prompt.reference)
        else:
            self.secret = random.Random(seed).randint(self.low, self.high)
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"guess env: secret {self.secret} outside [{self.low}, {self.high}]")
        self.guesses = 0
        return []

    def step(self, action_ids: list[int], action_text: str) -> StepResult:
        eos_found = bool(action_ids) and action_ids[-1] == self.eos_id
        guess = parse_guess(action_text, eos_found, self.low, self.high)
        self.guesses += 1
        info = {"guesses": self.guesses, "valid": float(guess is not None)}
        if guess is None:
            return StepResult(self._encode(INVALID), self.invalid_reward, False, info)
        if guess == self.secret:
            return StepResult(self._encode(CORRECT), self.correct_reward, True, {**info, "solved": 1.0})
        hint = HIGHER if guess < self.secret else LOWER
        return StepResult(self._encode(hint), self.wrong_reward, False, info)

    def _encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)  # token ids: the observation is exactly this text


def build_guess_prompts(tokenizer: Any, num: int, low: int = 0, high: int = 9, seed: int = 0,
                        split: str = "train") -> list[Prompt]:
    """`num` prompts "<low>-<high>:" with seeded secrets as references; uids "guess-<split>-<i>"."""
    tokenizer = load_tokenizer(tokenizer)
    rng = random.Random(f"{seed}-{split}")
    text = f"{low}-{high}:"
    ids = encode_text(tokenizer, text)
    return [Prompt(uid=f"guess-{split}-{i}", prompt_ids=list(ids), reference=rng.randint(low, high), text=text)
            for i in range(num)]
