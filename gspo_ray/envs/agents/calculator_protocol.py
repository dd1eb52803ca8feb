"""The calculator's token protocol as a chat template and a vLLM tool parser, for the tiny char-level model.

    rollout:
      agent: {fn: "gspo_ray.envs.agents.calculator_agent:solve",
              chat_template: "gspo_ray.envs.agents.calculator_protocol:CHAT_TEMPLATE",
              tool_parser: "gspo_ray.envs.agents.calculator_protocol:CalculatorToolParser"}

Native transcript (gspo_ray/envs/calculator.py):  12+34= | c12+34<eos> | =46 | 46<eos>
The template writes user and tool messages as their text, an assistant tool call as "c" + expression + EOS and any
other assistant message as its text + EOS, and no generation prompt: the rendering of a conversation is the native
transcript. The parser reads a reply "c<expression>" (the model stopped) as a call of the `calculator` tool.
"""
from __future__ import annotations

import json
import uuid

from vllm.entrypoints.generate.base.protocol import ExtractedToolCallInformation, FunctionCall, ToolCall
from vllm.tool_parsers.abstract_tool_parser import ToolParser

TOOL_PREFIX = "c"

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- if m.tool_calls -%}{%- for c in m.tool_calls -%}"
    "c{{ c.function.arguments.expression }}{{ eos_token }}"
    "{%- endfor -%}{%- else -%}{{ m.content }}{{ eos_token }}{%- endif -%}"
    "{%- else -%}{{ m.content }}{%- endif -%}"
    "{%- endfor -%}"
)


class CalculatorToolParser(ToolParser):
    """"c<expression>" -> one call of `calculator` with {"expression": ...}; anything else is text."""

    def extract_tool_calls(self, model_output: str, request) -> ExtractedToolCallInformation:
        if not model_output.startswith(TOOL_PREFIX):
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        args = json.dumps({"expression": model_output[len(TOOL_PREFIX):]})
        call = ToolCall(id=f"call_{uuid.uuid4().hex[:12]}", function=FunctionCall(name="calculator", arguments=args))
        return ExtractedToolCallInformation(tools_called=True, tool_calls=[call], content=None)
