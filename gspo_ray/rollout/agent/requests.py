"""What the endpoint accepts in a chat-completions request, and the OpenAI-style errors it answers otherwise.

    call = check_chat_request(body, SERVED_MODEL, temperature=1.0, top_p=1.0)   # -> ChatCall, or RequestError

Every sampled token is trained as the job's policy, so a request may not change the policy it samples from:
temperature and top_p must equal the job's (or be left out), `n` must be 1, and `logit_bias`, `top_k`, the
penalties, `min_p`, `seed`, `response_format`, forced tool choice and a model other than the served one are refused
with a 400 that names the parameter (the shape of OpenAI's own errors, so the agent's client raises
`openai.BadRequestError` with `param` set). `stop` is taken where each string is one token of the model's
vocabulary (the engine stops on token ids); `max_tokens` / `max_completion_tokens` is clamped later to the
episode's budget. Fields that do not touch sampling (`user`, `metadata`, `store`, `parallel_tool_calls`,
`stream_options`) are accepted and ignored.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

SERVED_MODEL = "policy"  # the model name the endpoint serves (also in each task as task["model"])

REFUSED = {  # parameter -> why it is refused
    "logit_bias": "it changes the sampling distribution away from the trained policy",
    "top_k": "it truncates the sampling distribution (the trainer scores the full one)",
    "min_p": "it truncates the sampling distribution (the trainer scores the full one)",
    "presence_penalty": "it changes the sampling distribution away from the trained policy",
    "frequency_penalty": "it changes the sampling distribution away from the trained policy",
    "repetition_penalty": "it changes the sampling distribution away from the trained policy",
    "seed": "the job seeds every call itself",
    "response_format": "constrained decoding changes the sampling distribution",
    "logprobs": "the endpoint returns no log-probs (they are recorded for training)",
    "top_logprobs": "the endpoint returns no log-probs (they are recorded for training)",
    "stream": "streaming is not served yet",
    "functions": "use `tools`",
    "function_call": "use `tool_choice`",
}
IGNORED = {"user", "metadata", "store", "parallel_tool_calls", "stream_options", "service_tier"}


class RequestError(Exception):
    """A request the endpoint refuses: HTTP status, message, the parameter at fault (OpenAI's error shape)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = "invalid_request", kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ChatCall:
    """A checked chat-completions request."""

    messages: list[dict]
    tools: list[dict] | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)


def _same_float(value: Any, job: float) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and abs(float(value) - job) <= 1e-9)


def check_messages(messages: Any) -> list[dict]:
    """A non-empty list of {"role": ..., ...} dicts."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(f"messages[{i}].role {m['role']!r} is not one of system, developer, user, "
                               "assistant, tool", f"messages[{i}].role")
    return messages


def _check_sampling(body: Any, model: str, temperature: float, top_p: float, known: set[str]) -> tuple[int | None,
                                                                                                  list[str]]:
    """The checks both APIs share; returns (max_tokens, stop strings)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for name in body:
        if name in REFUSED and body[name] not in (None, False):
            raise RequestError(f"{name} is not accepted: {REFUSED[name]}", name)
    if body.get("model") != model:
        raise RequestError(f"model {body.get('model')!r} is not served here; this endpoint serves {model!r}",
                           "model", code="model_not_found")
    if body.get("temperature") is not None and not _same_float(body["temperature"], temperature):
        raise RequestError(f"temperature {body['temperature']!r} differs from the job's ({temperature:g}): the "
                           "episode would be trained on a policy it was not sampled from", "temperature")
    if body.get("top_p") is not None and not _same_float(body["top_p"], top_p):
        raise RequestError(f"top_p {body['top_p']!r} differs from the job's ({top_p:g})", "top_p")
    if body.get("n") not in (None, 1):
        raise RequestError("n must be 1: one completion per call (the job's group size makes the samples)", "n")
    unknown = sorted(set(body) - known - {"model", "temperature", "top_p", "n", "max_tokens", "stop"} - IGNORED
                     - set(REFUSED))
    if unknown:
        raise RequestError(f"unknown parameter {unknown[0]!r}", unknown[0])
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    limit = body.get(limit_name)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise RequestError(f"{limit_name} must be a positive integer", limit_name)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must be a string or a list of non-empty strings", "stop")
    return limit, stop


def check_chat_request(body: Any, model: str, *, temperature: float, top_p: float) -> ChatCall:
    """The request as a ChatCall, or RequestError naming the first parameter the endpoint cannot honour."""
    limit, stop = _check_sampling(body, model, temperature, top_p,
                                  {"messages", "tools", "tool_choice", "max_completion_tokens"})
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise RequestError("tool_choice may be 'auto' or 'none' (forcing a tool would constrain decoding)",
                           "tool_choice")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools)):
        raise RequestError("tools must be a list of {'type': 'function', 'function': {'name': ...}}", "tools")
    return ChatCall(check_messages(body.get("messages")), tools or None, limit, stop)


def check_completion_request(body: Any, model: str, *, temperature: float, top_p: float) -> tuple[str, int | None,
                                                                                                  list[str]]:
    """(prompt text, max_tokens, stop strings) of a text-completions request, or RequestError."""
    limit, stop = _check_sampling(body, model, temperature, top_p, {"prompt", "echo", "suffix"})
    for name in ("echo", "suffix"):
        if body.get(name):
            raise RequestError(f"{name} is not served", name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("prompt must be one non-empty string", "prompt")
    return prompt, limit, stop
