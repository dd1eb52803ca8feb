"""Token-exact recording of an agent's episode: the ids the engine produced are kept, never re-rendered.

    renderer = ChatRenderer(tokenizer, chat_template=None)           # the model's HF chat template
    rec = EpisodeTranscript(renderer, eos_token_ids={1})
    plan = rec.plan(messages, tools)                                  # the engine's context for this call
    rec.commit(plan, token_ids, logprobs, version, reply)             # the model's reply, as ids + log-probs

The exactness rule: chat templates drop earlier turns' reasoning, re-space text and render tool calls from their
parsed form, so rendering a whole conversation again would not give the tokens the model sampled. A call extends
the episode when its messages are the previous call's messages, then the model's reply (matched by content: the
text and the tool calls' names and arguments), then new messages. Only the new messages are rendered, as the
template's own text after the reply: render(previous + reply + new, with the generation prompt) minus
render(previous + reply), which must be a prefix of it. Where the model ended its reply with a stop token the
template writes too (`<|im_end|>`), the template's text after that token (a newline, say) belongs to the new
tokens. Those ids are appended after the reply's ids, loss-masked 0. Anything else (an edited, dropped or
summarised turn, other tools, a template that does not render the conversation as a prefix) starts a new
training sample from the rendered request; the episode counts a history split. Text completions
(`plan_text`) follow the same rule on text: a prompt that is the previous prompt + the reply + more appends the
encoded rest.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


def normalize_message(m: dict) -> dict:
    """A message as compared and rendered: None-valued keys dropped (clients echo `refusal: None` and the like),
    tool-call arguments parsed from their JSON text (the HF convention templates expect)."""
    out = {k: v for k, v in m.items() if v is not None}
    calls = out.get("tool_calls")
    if calls:
        out["tool_calls"] = [_normalize_call(c) for c in calls]
    elif "tool_calls" in out:
        del out["tool_calls"]
    return out


def _normalize_call(c: Any) -> dict:
    if not isinstance(c, dict):
        return c
    fn = dict(c.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:
            pass  # left as text: the template shows it as is
    return {"type": c.get("type", "function"), **({"id": c["id"]} if c.get("id") else {}), "function": fn}


def _call_key(c: dict) -> tuple:
    fn = _normalize_call(c).get("function") or {}  # arguments as parsed JSON, whichever form came
    return fn.get("name"), json.dumps(fn.get("arguments"), sort_keys=True)


def same_reply(sent: dict, reply: dict) -> bool:
    """Whether a message the agent sent back is the reply the endpoint gave (content and tool calls; ids and
    extra fields aside)."""
    if sent.get("role") != "assistant":
        return False
    if (sent.get("content") or "") != (reply.get("content") or ""):
        return False
    return [_call_key(c) for c in sent.get("tool_calls") or []] == [_call_key(c) for c in
                                                                    reply.get("tool_calls") or []]


def same_history(a: list[dict], b: list[dict]) -> bool:
    """Messages equal up to None-valued keys and tool-call ids."""
    def key(m: dict) -> dict:
        m = dict(m)
        m["tool_calls"] = [_call_key(c) for c in m.get("tool_calls") or []]
        return m

    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b))


class ChatRenderer:
    """Messages (and tools) -> text with the model's chat template (or `chat_template`) -> ids, no specials added
    (the template writes them)."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None):
        self.tokenizer, self.template = tokenizer, chat_template
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template; "
                             "set rollout.agent.chat_template")

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@dataclass
class SampleRecord:
    """One training sample of an episode: prompt ids, then model tokens (mask 1) and rendered tokens (mask 0)."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    turns: int = 0

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.ids


@dataclass
class Plan:
    """A call's effect on the record before the model answers: extend the current sample with `rendered` ids, or
    start a new sample whose prompt is `rendered`."""

    new_sample: bool
    rendered: list[int]
    context: list[int]
    messages: list[dict] | None  # None: a text-completions call (`prompt` instead)
    tools: list[dict] | None = None
    prompt: str | None = None


class EpisodeTranscript:
    """The samples of one episode, as the engine produced them (see the module docstring)."""

    def __init__(self, renderer: ChatRenderer, eos_token_ids: frozenset[int] | set[int]):
        self.renderer = renderer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.samples: list[SampleRecord] = []
        self.splits = 0  # calls that did not extend the history the engine saw
        self.calls = 0  # model calls committed
        self.rendered_tokens = 0
        self._last: tuple[list[dict], list[dict] | None, dict, bool] | None = None  # messages, tools, reply, eos
        self._last_text: tuple[str, list[str]] | None = None  # a text call's prompt; its reply with / without eos

    @property
    def completion_tokens(self) -> int:
        """Model + rendered tokens over the episode's samples (what rollout.agent.max_total_tokens bounds)."""
        return sum(len(s.ids) for s in self.samples)

    def plan(self, messages: list[dict], tools: list[dict] | None) -> Plan:
        """The engine context for a call with these messages (nothing recorded yet)."""
        messages = [normalize_message(m) for m in messages]
        appended = self._extension(messages, tools)
        if appended is not None:
            return Plan(False, appended, self.samples[-1].context + appended, messages, tools)
        prompt = self.renderer.encode(self.renderer.render(messages, tools, add_generation_prompt=True))
        return Plan(True, prompt, prompt, messages, tools)

    def plan_text(self, prompt: str) -> Plan:
        """The engine context for a text-completions call: when `prompt` is the previous call's prompt + its reply
        (the reply's text with or without its stop token) + more, only the rest is encoded and appended."""
        if self._last_text is not None and self.samples:
            before, replies = self._last_text
            for reply in replies:
                if prompt.startswith(before + reply):
                    rest = self.renderer.encode(prompt[len(before + reply):])
                    return Plan(False, rest, self.samples[-1].context + rest, None, prompt=prompt)
        ids = self.renderer.encode(prompt)
        return Plan(True, ids, ids, None, prompt=prompt)

    def commit(self, plan: Plan, token_ids: list[int], logprobs: list[float], version: int | list[int],
               reply: dict, rendered_version: int | None = None) -> None:
        """Record a call: its rendered ids (mask 0), then the model's ids and engine log-probs (mask 1). `version`:
        the policy version of every token, or one per token (a call continued across a weight update);
        `rendered_version`: the rendered ids' (default: the first token's)."""
        versions = [version] * len(token_ids) if isinstance(version, int) else list(version)
        if len(versions) != len(token_ids):
            raise ValueError(f"{len(versions)} versions for {len(token_ids)} tokens")
        if rendered_version is None:
            rendered_version = versions[0] if versions else (version if isinstance(version, int) else 0)
        if plan.new_sample:
            if self.samples:
                self.splits += 1
            self.samples.append(SampleRecord(list(plan.rendered)))
        else:
            self._add(self.samples[-1], plan.rendered, [0.0] * len(plan.rendered), 0,
                      [rendered_version] * len(plan.rendered))
            self.rendered_tokens += len(plan.rendered)
        s = self.samples[-1]
        if token_ids:
            s.turn_starts.append(len(s.ids))
        self._add(s, token_ids, logprobs, 1, versions)
        s.turns += 1
        self.calls += 1
        stopped = bool(token_ids) and token_ids[-1] in self.eos_token_ids
        if plan.messages is None:  # a text call: the next one may extend it as text
            full = self.renderer.decode(token_ids)
            self._last, self._last_text = None, (plan.prompt, [full, reply.get("text", full)])
        else:
            self._last, self._last_text = (plan.messages, plan.tools, reply, stopped), None

    @staticmethod
    def _add(s: SampleRecord, ids: list[int], logprobs: list[float], mask: int, versions: list[int]) -> None:
        s.ids += ids
        s.logprobs += logprobs
        s.mask += [mask] * len(ids)
        s.versions += versions

    def _extension(self, messages: list[dict], tools: list[dict] | None) -> list[int] | None:
        """The ids of the new messages when `messages` extends the last call (module docstring), else None."""
        if self._last is None:
            return None
        prev, prev_tools, reply, stopped = self._last
        k = len(prev)
        if (tools != prev_tools or len(messages) <= k or not same_history(messages[:k], prev)
                or not same_reply(messages[k], reply)):
            return None
        r = self.renderer
        with_reply = r.render(messages[:k + 1], tools, add_generation_prompt=False)
        full = r.render(messages, tools, add_generation_prompt=True)
        if not full.startswith(with_reply):
            return None
        tail = ""
        if stopped:  # the template's text after the stop token the model sampled (e.g. "\n" after <|im_end|>)
            asked = r.render(messages[:k], tools, add_generation_prompt=True)
            reply_part = with_reply[len(asked):] if with_reply.startswith(asked) else ""
            eos_text = r.decode([self.samples[-1].ids[-1]])
            at = reply_part.rfind(eos_text) if eos_text else -1
            tail = reply_part[at + len(eos_text):] if at >= 0 else ""
        return r.encode(tail + full[len(with_reply):])
