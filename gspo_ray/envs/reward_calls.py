"""How a reward function is called: the keyword arguments it gets, and one reward per data_source.

    call_kwargs = build_call_kwargs(fn, {"bonus": 0.5})        # checked once against the protocol
    fn(text, reference, **call_kwargs(context))                  # context: CONTEXT_KWARGS, meta["fields"] the row's
    fn = resolve_reward({"gsm8k": "gspo_ray.envs.rewards:math_verify_reward", "*": "my.rewards:score"})

The protocol is in `gspo_ray.envs.rewards`. A row's other fields (the columns besides the prompt and the reference,
nested as they are) reach the function as keyword arguments, as TRL passes dataset columns: a function that
declares `data_source` or `extra_info` gets them, one that takes `**kwargs` gets every field. The runner's context
arguments and `reward.kwargs` win over a field of the same name; a field named like the two positional
parameters is not passed. Every field also stays in `meta["fields"]`.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from gspo_ray.envs.plugins import PluginError, resolve_callable

# Passed by the runner on every call (protocol in gspo_ray.envs.rewards); reward.kwargs may not override them.
CONTEXT_KWARGS = ("completion_ids", "finish_reason", "eos_found", "prompt_text", "meta")
DATA_SOURCE_FIELD = "data_source"  # the row field RoutedReward routes on (verl's name)
DEFAULT_ROUTE = "*"  # the route of a data_source the mapping does not name


def row_fields(context: dict[str, Any]) -> dict[str, Any]:
    """The row's other fields, from `context["meta"]["fields"]` ({} when there are none)."""
    meta = context.get("meta")
    fields = meta.get("fields") if isinstance(meta, dict) else None
    return fields if isinstance(fields, dict) else {}


def build_call_kwargs(fn: Callable, fn_kwargs: dict[str, Any], field_name: str = "reward") -> Callable[[dict], dict]:
    """Check `fn` against the reward protocol once, up front; return a filter that keeps the context keyword
    arguments and row fields `fn` declares (all of them when it takes **kwargs). Errors name `<field_name>.fn` /
    `.kwargs`."""
    clash = sorted(set(fn_kwargs) & set(CONTEXT_KWARGS))
    if clash:
        raise PluginError(f"{field_name}.kwargs may not set {clash}: the runner passes them on every call")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins have no signature: pass what the protocol promises
        return lambda context: {**context, **fn_kwargs}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    name = getattr(fn, "__name__", fn)
    unfilled = [p for p in positional[2:] if p.default is p.empty and p.name not in fn_kwargs
                and p.name not in CONTEXT_KWARGS]  # positional arguments no call would give
    if unfilled:
        raise PluginError(f"{field_name}.fn: {name!r} is called as fn(completion, reference, **context), once per "
                          f"sample; its signature {inspect.signature(fn)} needs more positional arguments (verl's "
                          "compute_score(data_source, solution_str, ground_truth, extra_info) becomes "
                          "fn(solution_str, ground_truth, *, meta): docs/real-models.md)")
    batch = {p.name for p in params} & {"completions", "prompts"}
    if batch or (len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params)):
        raise PluginError(f"{field_name}.fn: {name!r} must take (completion, reference) "
                          f"positionally and is called once per sample (one completion's text, not a batch "
                          f"of them as TRL passes); its signature is {inspect.signature(fn)}")
    reserved = set(CONTEXT_KWARGS) | set(fn_kwargs) | {p.name for p in positional[:2]}
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return lambda context: {**{k: v for k, v in row_fields(context).items() if k not in reserved}, **context,
                                **fn_kwargs}
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(set(fn_kwargs) - names)
    if unknown:
        raise PluginError(f"{field_name}.kwargs: {getattr(fn, '__name__', fn)!r} takes no argument(s) {unknown}; "
                          f"its signature is {inspect.signature(fn)}")
    required = {p.name for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty}
    missing = sorted(required - set(fn_kwargs) - set(CONTEXT_KWARGS))
    if missing:
        raise PluginError(f"{field_name}.kwargs: {getattr(fn, '__name__', fn)!r} requires {missing}")
    wanted = [k for k in CONTEXT_KWARGS if k in names]
    declared = names - reserved
    return lambda context: {**{k: v for k, v in row_fields(context).items() if k in declared},
                            **{k: context[k] for k in wanted}, **fn_kwargs}


def accepted_kwargs(fn: Callable, fn_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The entries of `fn_kwargs` that `fn` declares (all of them when it takes **kwargs or has no signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return dict(fn_kwargs)
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return dict(fn_kwargs)
    return {k: v for k, v in fn_kwargs.items() if k in {p.name for p in params}}


class RoutedReward:
    """One reward function per data_source: a row's `data_source` field picks the function (`"*"`: any other).

    Called like a reward function (completion, reference, **context); each route gets the keyword arguments it
    declares, and those of `fn_kwargs` it takes. Pickles as its import paths, so a reward process re-imports them.
    """

    def __init__(self, routes: dict[str, str | Callable], fn_kwargs: dict[str, Any] | None = None,
                 field_name: str = "rollout.reward"):
        if not routes:
            raise PluginError(f"{field_name}.fn: an empty mapping; map each data_source to a reward function")
        self.routes, self.fn_kwargs, self.field_name = dict(routes), dict(fn_kwargs or {}), field_name
        self.fns = {k: resolve_callable(v, f"{field_name}.fn.{k}") for k, v in self.routes.items()}
        self._calls = {k: build_call_kwargs(fn, accepted_kwargs(fn, self.fn_kwargs), f"{field_name}.fn.{k}")
                       for k, fn in self.fns.items()}
        unused = sorted(k for k in self.fn_kwargs if not any(k in accepted_kwargs(fn, self.fn_kwargs)
                                                             for fn in self.fns.values()))
        if unused:
            raise PluginError(f"{field_name}.kwargs: no mapped reward function takes {unused}")

    def route(self, data_source: Any) -> str | None:
        """The mapping's key for a row's data_source, or None when it maps to nothing."""
        if isinstance(data_source, str) and data_source in self.routes:
            return data_source
        return DEFAULT_ROUTE if DEFAULT_ROUTE in self.routes else None

    def __call__(self, completion: str, reference: Any, **context: Any) -> Any:
        context = {k: context[k] for k in CONTEXT_KWARGS if k in context}  # fields come again from meta
        data_source = row_fields(context).get(DATA_SOURCE_FIELD)
        key = self.route(data_source)
        if key is None:
            raise KeyError(f"data_source {data_source!r} maps to no reward function (mapped: "
                           f"{', '.join(self.routes)})")
        return self.fns[key](completion, reference, **self._calls[key](context))

    def __reduce__(self) -> tuple:
        return RoutedReward, (self.routes, self.fn_kwargs, self.field_name)


def resolve_reward(fn_or_routes: str | Callable | dict, field_name: str = "rollout.reward",
                   fn_kwargs: dict[str, Any] | None = None) -> Callable:
    """`reward.fn` as a callable: an import path or callable as is, a mapping data_source -> import path as a
    RoutedReward. Errors name `<field_name>.fn`."""
    if isinstance(fn_or_routes, dict):
        return RoutedReward(fn_or_routes, fn_kwargs, field_name)
    return resolve_callable(fn_or_routes, f"{field_name}.fn")
