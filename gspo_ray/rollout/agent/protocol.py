"""The agent protocol's plug-in side: loading the agent, reading its return value, the chat template setting.

    fn = load_agent("my_pkg.agents:solve")          # an async callable of (client, task, **kwargs)
    reward, extras = agent_outcome({"reward": 1.0, "calls": 2})

Light on purpose (no engine, no vLLM): the preflight, the agent processes and the runner all use it.
"""
from __future__ import annotations

import math
import numbers
from typing import Any


def load_agent(fn_path: str, field: str = "rollout.agent.fn"):
    """The agent callable, checked to be async (`async def`, or an object whose __call__ is)."""
    import inspect

    from gspo_ray.envs.plugins import PluginError, resolve_callable

    fn = resolve_callable(fn_path, field)
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))):
        raise PluginError(f"{field}: {fn_path!r} is not an async callable; the protocol is "
                          "`async def solve(client, task) -> float | dict`")
    return fn


def resolve_chat_template(spec: str | None) -> str | None:
    """rollout.agent.chat_template: a file path, an import path `module:NAME` of a string, or the Jinja text."""
    import os
    import re

    if spec is None:
        return None
    if os.path.isfile(spec):
        with open(spec) as f:
            return f.read()
    if re.fullmatch(r"[\w.]+:[\w.]+", spec):
        from gspo_ray.envs.plugins import resolve_import_path

        value = resolve_import_path(spec, "rollout.agent.chat_template")
        if not isinstance(value, str):
            raise ValueError(f"rollout.agent.chat_template: {spec!r} is a {type(value).__name__}, not a string")
        return value
    return spec


def agent_outcome(value: Any) -> tuple[float, dict[str, float]]:
    """(reward, numeric extras) from an agent's return value; ValueError naming what is wrong."""
    extras = {}
    if isinstance(value, dict):
        extras = {f"agent/{k}": float(v) for k, v in value.items() if k != "reward" and isinstance(v, numbers.Real)
                  and not isinstance(v, bool) and math.isfinite(float(v))}
        if "reward" not in value:
            raise ValueError(f"the agent returned a dict without 'reward' (keys {sorted(value)[:8]})")
        value = value["reward"]
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        shown = repr(value) if isinstance(value, numbers.Real) else type(value).__name__
        raise ValueError(f"the agent returned reward {shown}; expected a finite float (or a dict with 'reward')")
    return float(value), extras
