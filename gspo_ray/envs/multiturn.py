"""Multi-turn environments: the protocol, its typed records, and the checks applied to everything an env returns.

    env_cls = check_env("gspo_ray.envs.guess:GuessNumberEnv")         # pre-flight; errors name the config field
    env = env_cls(tokenizer=tokenizer, **cfg.kwargs)                     # one object per episode
    obs = env.reset(prompt, seed)                                        # list[int] | str, appended to the context
    result = env.step(action_ids, action_text)                           # -> StepResult(observation, reward, done)

Protocol (duck-typed; `MultiTurnEnv` spells it out):
- `cls(tokenizer=..., **kwargs)`: the tokenizer is an HF tokenizer object (or a model directory; `load_tokenizer`
  turns it into one). The env uses it to encode its observations.
- `reset(prompt: Prompt, seed: int) -> list[int] | str`: the first observation, appended after the prompt
  (often empty: the prompt already states the task). `seed` is the same for every episode of one prompt, so a
  group of completions faces the same task (group-relative advantages compare like with like).
- `step(action_ids: list[int], action_text: str) -> StepResult`: `action_ids` are the model's tokens of this turn
  (ending with EOS when the model stopped, else cut at the turn limit); `action_text` is their text up to the
  first EOS (special tokens kept, EOS left out). The observation is appended to the context as environment
  tokens; `reward` is this turn's reward; `done` ends the episode.
- `replayable = True` (a class attribute, optional; `is_replayable`): the env declares that reset and step depend
  only on (prompt, seed, actions). rollout.partial needs it: an episode carried to a worker that does not hold it
  is rebuilt by a fresh env reset with the same seed and stepped with the recorded actions
  (gspo_ray/rollout/episode_replay.py).

Observations are token ids (used as they are) or text (encoded without special tokens; the text must decode back
exactly, so the token transcript reads as the env wrote it). Whatever an env returns is checked here before it
can reach the engine: token ids must be ints inside the vocabulary, rewards finite numbers, `done` a bool;
anything else raises `EnvError`, which ends that episode only (see gspo_ray/rollout/episodes.py).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from gspo_ray.data.records import Prompt
from gspo_ray.envs.plugins import PluginError, resolve_import_path

Observation = list[int] | str


class EnvError(RuntimeError):
    """An environment raised, overran its timeout, or returned something malformed (ends its episode only)."""


@dataclass
class StepResult:
    """What one env step returns: the observation appended after the action, this turn's reward, the end flag."""

    observation: Observation = ""
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)  # numeric entries end up in Sample.reward_info


@runtime_checkable
class MultiTurnEnv(Protocol):
    """The environment protocol (see the module docstring); implementations need not inherit from it. The optional
    class attribute `replayable = True` is not listed as a member (a runtime-checkable protocol would then require
    it, and issubclass refuses protocols with data members): `is_replayable` reads it."""

    def reset(self, prompt: Prompt, seed: int) -> Observation: ...

    def step(self, action_ids: list[int], action_text: str) -> StepResult: ...


def is_replayable(env_cls: type) -> bool:
    """Whether the env class declares `replayable = True` (exactly True: a truthy stand-in declares nothing)."""
    return getattr(env_cls, "replayable", False) is True


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` (no special tokens added) that decode back to exactly `text`; EnvError otherwise."""
    if not text:
        return []
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if back != text:
        raise EnvError(f"observation text {text!r} does not survive the tokenizer (decodes to {back!r})")
    return ids


def decode_action(tokenizer: Any, action_ids: list[int], eos_token_ids: frozenset[int]) -> tuple[str, bool]:
    """(text of the action up to its first EOS, special tokens kept; whether an EOS was found)."""
    cut = next((i for i, t in enumerate(action_ids) if t in eos_token_ids), None)
    ids = action_ids if cut is None else action_ids[:cut]
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return text, cut is not None


def check_observation(obs: Any, tokenizer: Any, vocab_size: int, where: str) -> list[int]:
    """An observation as token ids: ids must be ints in [0, vocab_size); text is encoded (and must round-trip)."""
    if isinstance(obs, str):
        return encode_text(tokenizer, obs)
    if isinstance(obs, (list, tuple)):
        bad = [t for t in obs if isinstance(t, bool) or not isinstance(t, numbers.Integral)
               or not 0 <= int(t) < vocab_size]
        if bad:
            raise EnvError(f"{where} returned malformed token ids {bad[:5]!r} (need ints in [0, {vocab_size}))")
        return [int(t) for t in obs]
    raise EnvError(f"{where} returned a {type(obs).__name__} observation; expected list[int] or str")


def check_step_result(result: Any, tokenizer: Any, vocab_size: int) -> tuple[list[int], float, bool, dict]:
    """(observation ids, reward, done, info) from a StepResult; EnvError naming what is malformed."""
    if not isinstance(result, StepResult):
        raise EnvError(f"step returned a {type(result).__name__}; expected a StepResult")
    obs = check_observation(result.observation, tokenizer, vocab_size, "step")
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        shown = repr(reward) if isinstance(reward, numbers.Real) else type(reward).__name__
        raise EnvError(f"step returned malformed reward {shown}; expected a finite float")
    if not isinstance(result.done, bool):
        raise EnvError(f"step returned done={result.done!r}; expected a bool")
    if not isinstance(result.info, dict):
        raise EnvError(f"step returned info of type {type(result.info).__name__}; expected a dict")
    return obs, float(reward), result.done, result.info


def numeric_info(info: dict[str, Any], prefix: str = "env/") -> dict[str, float]:
    """The finite numeric entries of an env's info dict, keys prefixed (Sample.reward_info holds floats only)."""
    return {f"{prefix}{k}": float(v) for k, v in info.items()
            if isinstance(v, numbers.Real) and math.isfinite(float(v))}


def check_env(env: str | type, field_name: str = "rollout.multi_turn.env") -> type:
    """Resolve an environment class (import path or class) and check it has `reset` and `step`; errors name
    `field_name`, so a typo in the job YAML fails before any engine starts."""
    cls = resolve_import_path(env, field_name) if isinstance(env, str) else env
    if not isinstance(cls, type):
        raise PluginError(f"{field_name}: {env!r} resolved to a {type(cls).__name__}; expected a class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise PluginError(f"{field_name}: {cls.__name__} has no method(s) {missing} (protocol: "
                          "reset(prompt, seed) -> ids | text, step(action_ids, action_text) -> StepResult)")
    return cls
