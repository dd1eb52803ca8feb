"""The calculator task as an agent: the OpenAI chat API with one tool, nothing else (no gspo-ray import).

    rollout:
      agent: {fn: "gspo_ray.envs.agents.calculator_agent:solve", kwargs: {max_calls: 2}, ...}   # see
             # gspo_ray/envs/agents/calculator_protocol.py for the tiny model's template and tool parser

`solve(client, task)` asks the question, runs the `calculator` tool for each call the model makes (at most
`max_calls`; one more ends the episode unanswered), and returns 1.0 when the final answer equals the reference.
It is the native CalculatorEnv's rules, so with the protocol's template the episodes are the same tokens.
"""
from __future__ import annotations

import json
import re

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "evaluate an arithmetic expression (digits and + - *)",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
_NUMBER, _ANSWER, _MAX_ABS = re.compile(r"\d{1,6}"), re.compile(r"-?\d+"), 10 ** 12


def calculate(expr: str) -> int | None:
    """number (op number)*, op in + - *, '*' binding tighter, an optional leading '-'; None when malformed."""
    sign = 1
    if expr.startswith("-"):
        sign, expr = -1, expr[1:]
    tokens = re.split(r"([+\-*])", expr)
    numbers, ops = tokens[0::2], tokens[1::2]
    if not all(_NUMBER.fullmatch(n) for n in numbers):
        return None
    total, term = 0, sign * int(numbers[0])
    for op, num in zip(ops, numbers[1:]):
        if op == "*":
            term *= int(num)
        else:
            total, term = total + term, int(num) if op == "+" else -int(num)
        if abs(term) >= _MAX_ABS:
            return None
    total += term
    return total if abs(total) < _MAX_ABS else None


async def solve(client, task: dict, max_calls: int = 2, max_tokens: int = 4, correct_reward: float = 1.0,
                call_reward: float = 0.0) -> dict:
    """One episode: the reward (`correct_reward` for the right answer, plus `call_reward` per well-formed call)
    and whether the answer was right."""
    messages = [{"role": "user", "content": task["prompt"]}]
    calls, shaping = 0, 0.0
    while True:
        response = await client.chat.completions.create(model=task["model"], messages=messages, tools=[CALCULATOR],
                                                        max_tokens=max_tokens)
        choice = response.choices[0]
        reply = choice.message
        cut_call = choice.finish_reason == "length" and (reply.content or "").startswith("c")
        if not reply.tool_calls and not cut_call:  # the final answer
            answer = reply.content or ""
            correct = (choice.finish_reason == "stop" and _ANSWER.fullmatch(answer) is not None
                       and answer == str(task["reference"]))
            return {"reward": shaping + (correct_reward if correct else 0.0), "correct": float(correct),
                    "calls": calls}
        if calls >= max_calls:  # out of calls: the episode ends unanswered
            return {"reward": shaping, "correct": 0.0, "calls": calls}
        calls += 1
        if cut_call:  # a call cut off by max_tokens is malformed: the protocol answers "*"
            messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "*"}]
            continue
        call = reply.tool_calls[0]
        value = calculate(json.loads(call.function.arguments).get("expression", ""))
        shaping += 0.0 if value is None else call_reward
        messages += [reply.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "*" if value is None else f"={value}"}]
