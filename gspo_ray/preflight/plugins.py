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
        raise PreflightError(f"{one_line(e, 600)}; protocol: fn(completion, reference, **context) -> float | dict "
                             "(docs/real-models.md#the-reward-protocol)") from None
    return fn


def import_env(cfg: JobConfig, import_timeout_s: float) -> type | None:
    from gspo_ray.envs.multiturn import check_env, is_replayable

    mt = cfg.rollout.multi_turn
    if mt is None:
        return None
    if "tokenizer" in mt.kwargs:
        raise PreflightError("rollout.multi_turn.kwargs: may not set 'tokenizer'; the runner passes the model's")
    env_cls = call_with_timeout(lambda: check_env(mt.env, "rollout.multi_turn.env"), import_timeout_s,
                                f"rollout.multi_turn.env: importing {mt.env!r}")
    if cfg.rollout.partial is not None and not is_replayable(env_cls):
        raise PreflightError(f"rollout.multi_turn.env: {mt.env!r} does not declare `replayable = True`, which "
                             "rollout.partial needs: an episode carried to a worker that does not hold it is rebuilt "
                             "by replaying its env (reset with the same seed, then the recorded actions), so reset "
                             "and step must be deterministic given them; declare it if they are, or drop "
                             "rollout.partial")
    return env_cls


# What the dry calls feed the reward besides the reference answer: what models really write. (label, text,
# stopped); "{ref}" is the reference. The last one is the text of eval's JSONL, which keeps the EOS text.
DRY_COMPLETIONS = (("an empty completion", "", True),
                   ("a sentence", "The answer is {ref}.", True),
                   ("a long line cut at max_new_tokens", "Let me think step by step about this. " * 64, False),
                   ("the reference followed by the end-of-sequence text", "{ref}", True))


def dry_inputs(tokenizer, reference, max_new_tokens: int) -> list[tuple[str, str, list[int], bool]]:
    """(label, completion text, completion ids, eos found) of every dry call: the reference answered and
    stopped first, then DRY_COMPLETIONS as the model's tokenizer encodes them, cut to `max_new_tokens` like a
    real completion; the text is what the runner decodes (up to the first EOS, special tokens kept)."""
    ref = "" if reference is None else str(reference)
    calls = []
    for label, text, stopped in [("the reference answer", ref, True), *DRY_COMPLETIONS]:
        ids = list(tokenizer.encode(text.format(ref=ref), add_special_tokens=False))
        ids = ids[: max_new_tokens - 1] + [tokenizer.eos_token_id] if stopped else ids[:max_new_tokens]
        body = ids[:-1] if stopped else ids
        decoded = tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if label == DRY_COMPLETIONS[-1][0]:
            decoded += tokenizer.eos_token or ""
        calls.append((label, decoded, ids, stopped))
    return calls


def dry_reward(cfg: JobConfig, fn: Callable, tokenizer: Any, prompt: Prompt, report: PreflightReport) -> None:
    """Score the first prompt's reference as if the model had answered it and stopped, then a few completions
    a model really writes (empty, a sentence, a long line, the reference with the EOS text): a reward that
    raises on one of them, or returns no number, is an error naming that input."""
    from gspo_ray.rollout.scoring import build_call_kwargs, to_outcome

    r = cfg.rollout.reward
    call_kwargs = build_call_kwargs(fn, dict(r.kwargs), "rollout.reward")
    start, first = time.perf_counter(), None
    for label, text, ids, stopped in dry_inputs(tokenizer, prompt.reference, cfg.rollout.max_new_tokens):
        context = {"completion_ids": ids, "finish_reason": "stop" if stopped else "length", "eos_found": stopped,
                   "prompt_text": prompt.text, "meta": prompt.meta}
        kwargs = call_kwargs(context)
        where = (f"rollout.reward.fn: {r.fn!r} on a dry call with {label} (completion {text[:40]!r}, reference "
                 f"{str(prompt.reference)[:40]!r})")
        value = call_with_timeout(lambda: fn(text, prompt.reference, **kwargs), r.timeout_s, where,
                                  "rollout.reward.timeout_s")
        try:
            reward, _, _ = to_outcome(value, len(ids))
        except (TypeError, ValueError) as e:
            raise PreflightError(f"{where}: {one_line(e)}") from None
        first = reward if first is None else first
    report.add("reward", "ok", f"{r.fn}: {first:g} for the reference answer; {len(DRY_COMPLETIONS)} more dry calls "
                               f"(empty, a sentence, a long line, EOS text) scored "
                               f"({time.perf_counter() - start:.2f} s, {r.timeout_s:g} s allowed per call)")


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
                            f"{name}: building it", "rollout.multi_turn.step_timeout_s")
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
                            f"{name}: reset on a dry call", "rollout.multi_turn.step_timeout_s")
    try:
        ids = check_observation(obs, tokenizer, len(tokenizer), "reset")  # the vocabulary bound the runner uses
    except EnvError as e:
        raise PreflightError(f"{name}: {env_cls.__name__}.reset on a dry call: {one_line(e)}; valid: token ids "
                             "(list[int]) or text the tokenizer encodes and decodes back exactly") from None
    report.add("env", "ok", f"{mt.env}: reset gave a {len(ids)}-token observation")


def import_agent(cfg: JobConfig, import_timeout_s: float) -> Callable | None:
    """rollout.agent.fn imported and checked to be an async callable of (client, task, **kwargs); its chat template
    resolved. None when the job runs no agent. (The tool parser is a vLLM class: loaded where the engine runs.)"""
    agent = cfg.rollout.agent
    if agent is None:
        return None
    from gspo_ray.rollout.agent.protocol import load_agent, resolve_chat_template

    fn = call_with_timeout(lambda: load_agent(agent.fn, "rollout.agent.fn"), import_timeout_s,
                           f"rollout.agent.fn: importing {agent.fn!r}")
    try:
        inspect.signature(fn).bind(None, {}, **agent.kwargs)
    except TypeError as e:
        raise PreflightError(f"rollout.agent.fn: {agent.fn!r}{inspect.signature(fn)} does not take (client, task, "
                             f"**rollout.agent.kwargs): {e}; protocol: async def solve(client, task) -> float | "
                             "dict") from None
    except ValueError:  # no signature to inspect: the dry call tells
        pass
    call_with_timeout(lambda: resolve_chat_template(agent.chat_template), import_timeout_s,
                      "rollout.agent.chat_template: resolving it")
    return fn


def dry_agent(cfg: JobConfig, fn: Callable, prompt: Prompt, report: PreflightReport) -> None:
    """One episode of the agent on the first prompt against a stand-in endpoint (the real one needs the engine):
    the `openai` client it gets answers each call with the reference as the model's reply, after the endpoint's
    own request checks, so a refused parameter or a missing reward fails here, naming it."""
    from gspo_ray.rollout.agent.dry_run import dry_episode

    agent = cfg.rollout.agent
    where = f"rollout.agent.fn: {agent.fn!r} on a dry episode (the reference {str(prompt.reference)[:40]!r} as "
    where += "every reply)"
    start = time.perf_counter()
    try:
        reward, calls = dry_episode(fn, prompt, dict(agent.kwargs), cfg.rollout.temperature, cfg.rollout.top_p,
                                    agent.max_turns, agent.episode_timeout_s)
    except Exception as e:
        raise PreflightError(f"{where}: {one_line(e, 400)}") from None
    report.add("agent", "ok", f"{agent.fn}: {reward:g} after {calls} call(s) on a dry episode "
                              f"({time.perf_counter() - start:.2f} s)")
