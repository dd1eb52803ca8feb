"""The job's plug-ins: the reward function and environment class imported (with a timeout) and checked against
their protocols, then one dry call each."""
from __future__ import annotations

import inspect
import time
from typing import TYPE_CHECKING, Any, Callable

from gspo_ray.config import JobConfig
from gspo_ray.envs.plugins import PluginError
from gspo_ray.envs.reward_calls import resolve_reward
from gspo_ray.preflight.model import PreflightError
from gspo_ray.preflight.report import PreflightReport, call_with_timeout, one_line

if TYPE_CHECKING:
    from gspo_ray.data.records import Prompt


def import_reward(cfg: JobConfig, import_timeout_s: float) -> Callable:
    r = cfg.rollout.reward
    fn = call_with_timeout(lambda: resolve_reward(r.fn, "rollout.reward", dict(r.kwargs)), import_timeout_s,
                           f"rollout.reward.fn: importing {r.fn!r}")
    from gspo_ray.rollout.scoring import build_call_kwargs  # no engine; after the user's import (this one is torch)

    try:
        build_call_kwargs(fn, dict(r.kwargs), "rollout.reward")
    except PluginError as e:
        raise PreflightError(f"{one_line(e)}; protocol: fn(completion, reference, **context) -> float | dict "
                             "(gspo_ray/envs/rewards.py)") from None
    return fn


def import_env(cfg: JobConfig, import_timeout_s: float) -> type | None:
    from gspo_ray.envs.multiturn import check_env

    mt = cfg.rollout.multi_turn
    if mt is None:
        return None
    if "tokenizer" in mt.kwargs:
        raise PreflightError("rollout.multi_turn.kwargs: may not set 'tokenizer'; the runner passes the model's")
    return call_with_timeout(lambda: check_env(mt.env, "rollout.multi_turn.env"), import_timeout_s,
                             f"rollout.multi_turn.env: importing {mt.env!r}")


def dry_reward(cfg: JobConfig, fn: Callable, tokenizer: Any, prompt: Prompt, report: PreflightReport) -> None:
    """Score the first prompt's reference as if the model had answered it and stopped."""
    from gspo_ray.rollout.scoring import build_call_kwargs, to_outcome

    r = cfg.rollout.reward
    ref = prompt.reference
    ids = list(tokenizer.encode("" if ref is None else str(ref), add_special_tokens=False))
    ids = ids[: cfg.rollout.max_new_tokens - 1] + [tokenizer.eos_token_id]
    text = tokenizer.decode(ids[:-1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    context = {"completion_ids": ids, "finish_reason": "stop", "eos_found": True, "prompt_text": prompt.text,
               "meta": prompt.meta}
    kwargs = build_call_kwargs(fn, dict(r.kwargs), "rollout.reward")(context)
    where = f"rollout.reward.fn: {r.fn!r} on a dry call (completion {text[:40]!r}, reference {str(ref)[:40]!r})"
    start = time.perf_counter()
    value = call_with_timeout(lambda: fn(text, ref, **kwargs), r.timeout_s,
                              f"{where} (rollout.reward.timeout_s)")
    try:
        reward, _, _ = to_outcome(value, len(ids))
    except (TypeError, ValueError) as e:
        raise PreflightError(f"{where}: {one_line(e)}") from None
    report.add("reward", "ok", f"{r.fn}: {reward:g} for the reference answer "
                               f"({time.perf_counter() - start:.2f} s of {r.timeout_s:g} s allowed)")


def dry_env(cfg: JobConfig, env_cls: type, tokenizer: Any, prompt: Prompt, report: PreflightReport) -> None:
    """Build one environment and reset it on the first prompt; the observation must be ids or round-trip text."""
    from gspo_ray.envs.multiturn import EnvError, check_observation

    mt = cfg.rollout.multi_turn
    name = f"rollout.multi_turn.env: {mt.env!r}"
    try:
        inspect.signature(env_cls).bind(tokenizer=tokenizer, **mt.kwargs)
    except TypeError as e:
        raise PreflightError(f"rollout.multi_turn.kwargs: {env_cls.__name__}(tokenizer=..., **kwargs) does not fit "
                             f"its signature {inspect.signature(env_cls)}: {e}") from None
    except ValueError:  # no signature to inspect (builtins): the call below tells
        pass
    env = call_with_timeout(lambda: env_cls(tokenizer=tokenizer, **mt.kwargs), mt.step_timeout_s,
                            f"{name}: building it (rollout.multi_turn.step_timeout_s)")
    for method, args in (("reset", (prompt, 0)), ("step", ([0], ""))):
        try:
            inspect.signature(getattr(env, method)).bind(*args)
        except TypeError as e:
            raise PreflightError(f"{name}: {method}{inspect.signature(getattr(env, method))} does not take the "
                                 f"protocol's arguments ({e}); protocol: reset(prompt, seed), "
                                 "step(action_ids, action_text)") from None
        except ValueError:
            pass
    obs = call_with_timeout(lambda: env.reset(prompt, 0), mt.step_timeout_s,
                            f"{name}: reset on a dry call (rollout.multi_turn.step_timeout_s)")
    try:
        ids = check_observation(obs, tokenizer, len(tokenizer), "reset")  # the vocabulary bound the runner uses
    except EnvError as e:
        raise PreflightError(f"{name}: {env_cls.__name__}.reset on a dry call: {one_line(e)}; valid: token ids "
                             "(list[int]) or text the tokenizer encodes and decodes back exactly") from None
    report.add("env", "ok", f"{mt.env}: reset gave a {len(ids)}-token observation")
