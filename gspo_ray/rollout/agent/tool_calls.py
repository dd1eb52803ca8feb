"""The model's reply text -> an OpenAI assistant message, tool calls parsed by one of vLLM's tool parsers.

    parser = load_tool_parser("hermes", tokenizer, field="rollout.agent.tool_parser")   # or "module:Class"
    message = reply_message(parser, text, stopped=True, call=chat_call)

Parsing only reads the text the engine produced: it never changes a token (the ids are recorded as sampled).
A reply cut off by its token limit is returned as text (a half-written tool call is not a call).
"""
from __future__ import annotations

import uuid
from typing import Any

from gspo_ray.rollout.agent.requests import SERVED_MODEL, ChatCall


def load_tool_parser(spec: str | None, tokenizer: Any, field: str = "rollout.agent.tool_parser") -> Any:
    """A vLLM ToolParser class by registered name or `module:Class` import path (None: no tool parsing)."""
    if spec is None:
        return None
    from vllm.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager

    if ":" in spec:
        from gspo_ray.envs.plugins import resolve_import_path

        cls = resolve_import_path(spec, field)
    else:
        try:
            cls = ToolParserManager.get_tool_parser(spec)
        except KeyError:
            raise ValueError(f"{field}: no tool parser {spec!r} in vLLM; registered: "
                             f"{', '.join(sorted(ToolParserManager.list_registered()))}") from None
    if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
        raise ValueError(f"{field}: {spec!r} is a {type(cls).__name__}, not a vLLM ToolParser class")
    return cls


def reply_message(parser_cls: Any, tokenizer: Any, text: str, stopped: bool, call: ChatCall) -> dict:
    """{"role": "assistant", "content": ..., "tool_calls": [...]} for the reply `text` (stop token left out)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if parser_cls is None or not stopped or not call.tools:
        return message
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(model=SERVED_MODEL, messages=call.messages, tools=call.tools)
    info = parser_cls(tokenizer, request.tools).extract_tool_calls(text, request)
    if info.tools_called and info.tool_calls:
        message["content"] = info.content or None
        message["tool_calls"] = [{"id": c.id or f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in info.tool_calls]
    return message
