"""Token-exact recording of agent episodes and the endpoint's request checks, as functions of data (no engine).

The tiny char-level tokenizer knows only "0123456789copy:=+-*" (plus <pad> <eos> <bos>), so the test templates
write their markup in those characters: "y" opens a user turn, "o" an assistant turn, "*" is what a template writes
after the assistant's end-of-turn token (like the newline after Qwen's <|im_end|>).
"""
from __future__ import annotations

import pytest

from gspo_ray.models.tiny import build_tokenizer
from gspo_ray.rollout.agent.requests import RequestError, check_chat_request
from gspo_ray.rollout.agent.protocol import agent_outcome
from gspo_ray.rollout.agent.transcript import ChatRenderer, EpisodeTranscript

EOS = 1
TURNS = ("{%- for m in messages -%}{%- if m.role == 'assistant' -%}o{{ m.content }}{{ eos_token }}*"
         "{%- else -%}y{{ m.content }}{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}o{%- endif -%}")
# keeps only the last assistant turn's text, as reasoning templates drop earlier turns' thinking
LAST_ONLY = ("{%- for m in messages -%}{%- if m.role == 'assistant' -%}o{{ m.content if loop.last else '' }}"
             "{{ eos_token }}*{%- else -%}y{{ m.content }}{%- endif -%}{%- endfor -%}"
             "{%- if add_generation_prompt -%}o{%- endif -%}")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _reply(rec: EpisodeTranscript, tok, messages: list[dict], text: str, stop: bool = True) -> dict:
    """Plan a call, let the 'model' answer `text` (ids + EOS when stop), commit; returns the reply message."""
    plan = rec.plan(messages, None)
    ids = tok.encode(text, add_special_tokens=False) + ([EOS] if stop else [])
    reply = {"role": "assistant", "content": text}
    rec.commit(plan, ids, [-0.5] * len(ids), 3, reply)
    return reply


def test_extension_appends_only_the_new_messages_with_the_templates_tail(tok):
    rec = EpisodeTranscript(ChatRenderer(tok, TURNS), {EOS})
    first = [{"role": "user", "content": "12+34="}]
    reply = _reply(rec, tok, first, "46")
    # the model sampled "46<eos>": the template's "*" after <eos> and the next user turn are the new tokens
    second = first + [{**reply, "refusal": None}, {"role": "user", "content": "1"}]
    _reply(rec, tok, second, "7")
    (s,) = rec.samples
    assert tok.decode(s.prompt_ids) == "y12+34=o"
    assert tok.decode(s.ids) == "46<eos>*y1o7<eos>"
    assert s.mask == [1, 1, 1] + [0, 0, 0, 0] + [1, 1]
    assert s.logprobs == [-0.5] * 3 + [0.0] * 4 + [-0.5] * 2 and s.versions == [3] * 9
    assert s.turn_starts == [0, 7] and s.turns == 2 and rec.splits == 0


def test_a_cut_off_reply_gets_no_tail(tok):
    rec = EpisodeTranscript(ChatRenderer(tok, TURNS), {EOS})
    first = [{"role": "user", "content": "2="}]
    reply = _reply(rec, tok, first, "12", stop=False)  # cut at max_tokens: no <eos> was sampled
    _reply(rec, tok, first + [reply, {"role": "user", "content": "3"}], "4")
    assert tok.decode(rec.samples[0].ids) == "12y3o4<eos>" and rec.splits == 0


@pytest.mark.parametrize("change", ["edited", "dropped", "reply_changed", "template_drops_reply"])
def test_a_rewritten_history_starts_a_new_sample(tok, change):
    rec = EpisodeTranscript(ChatRenderer(tok, LAST_ONLY if change == "template_drops_reply" else TURNS), {EOS})
    first = [{"role": "user", "content": "1+1="}]
    reply = _reply(rec, tok, first, "2")
    new = {"role": "user", "content": "3"}
    second = {"edited": [{"role": "user", "content": "1+2="}, reply, new], "dropped": [new],
              "reply_changed": first + [{**reply, "content": "5"}, new],
              "template_drops_reply": first + [reply, new]}[change]
    _reply(rec, tok, second, "9")
    assert rec.splits == 1 and len(rec.samples) == 2
    renderer = rec.renderer
    assert rec.samples[1].prompt_ids == renderer.encode(renderer.render(second, None, True))
    assert rec.samples[1].mask == [1, 1]  # the new sample starts from the rendered request: prompt, then the reply


JOB = dict(temperature=1.0, top_p=1.0)
ASK = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("extra, param", [
    ({"model": "gpt-4o"}, "model"), ({"temperature": 0.7}, "temperature"), ({"top_p": 0.95}, "top_p"),
    ({"logit_bias": {"5": 1}}, "logit_bias"), ({"top_k": 4}, "top_k"), ({"frequency_penalty": 0.1}, "frequency_penalty"),
    ({"presence_penalty": 0.1}, "presence_penalty"), ({"n": 3}, "n"), ({"seed": 1}, "seed"),
    ({"tool_choice": "required"}, "tool_choice"), ({"max_tokens": 0}, "max_tokens"), ({"stream": True}, "stream"),
    ({"best_of": 2}, "best_of"), ({"messages": []}, "messages"), ({"messages": [{"content": "x"}]}, "messages[0]")])
def test_requests_that_would_change_the_trained_policy_are_refused(extra, param):
    with pytest.raises(RequestError) as err:
        check_chat_request({**ASK, **extra}, "policy", **JOB)
    assert err.value.param == param and err.value.status == 400
    assert err.value.body()["error"]["param"] == param


def test_the_jobs_own_sampling_is_accepted():
    call = check_chat_request({**ASK, "temperature": 1.0, "top_p": 1, "n": 1, "max_completion_tokens": 5,
                               "stop": "=", "user": "u", "tool_choice": "auto"}, "policy", **JOB)
    assert call.max_tokens == 5 and call.stop == ["="] and call.tools is None


def test_agent_outcome():
    assert agent_outcome(0.5) == (0.5, {})
    assert agent_outcome({"reward": 1, "calls": 2, "note": "x"}) == (1.0, {"agent/calls": 2.0})
    for bad in (None, "1", float("nan"), True, {"score": 1}):
        with pytest.raises(ValueError, match="reward"):
            agent_outcome(bad)


def test_text_completions_extend_by_text(tok):
    rec = EpisodeTranscript(ChatRenderer(tok, TURNS), {EOS})
    plan = rec.plan_text("1+2=")
    rec.commit(plan, [tok.convert_tokens_to_ids("3"), EOS], [-0.1, -0.2], 0, {"text": "3"})
    plan = rec.plan_text("1+2=3+4=")  # the reply's text without its stop token, then more
    assert not plan.new_sample and tok.decode(plan.rendered) == "+4="
    rec.commit(plan, [tok.convert_tokens_to_ids("7")], [-0.3], 1, {"text": "7"})
    (s,) = rec.samples
    assert tok.decode(s.prompt_ids + s.ids) == "1+2=3<eos>+4=7" and s.mask == [1, 1, 0, 0, 0, 1]
    assert s.versions == [0, 0, 1, 1, 1, 1]
    assert rec.plan_text("9=").new_sample  # not an extension: a new sample would start


def test_a_record_answers_the_calls_it_holds_until_the_agent_diverges():
    """ReplayRecord (a resumed episode): prompt [5, 6], reply [7, 8, 1], rendered [9], then a reply cut by a
    round after [3]. Calls whose context ends where a recorded reply starts get it (whole, or the cut one's part);
    a context that differs, or ends inside rendered ids, is not answered from the record."""
    from gspo_ray.data.records import Sample
    from gspo_ray.rollout.agent.replay import ReplayRecord

    record = ReplayRecord.from_sample(Sample(
        prompt_uid="p", sample_index=0, prompt_ids=[5, 6], completion_ids=[7, 8, 1, 9, 3],
        logprobs=[-0.1, -0.2, -0.3, 0.0, -0.4], loss_mask=[1, 1, 1, 0, 1], versions=[0, 0, 1, 1, 2],
        finish_reason="aborted", turn_starts=[0, 4]))
    first = record.match([5, 6])
    assert first.complete and first.ids == [7, 8, 1] and first.versions == [0, 0, 1]
    assert first.logprobs == [-0.1, -0.2, -0.3] and first.rendered_version is None
    cut = record.match([5, 6, 7, 8, 1, 9])
    assert not cut.complete and cut.ids == [3] and cut.versions == [2] and cut.rendered_version == 1
    assert record.match([5, 6, 7, 8, 1, 9, 3]).ids == []  # the record's end: nothing more to answer
    assert record.match([5, 4]) is None  # another first call: the agent diverged
    assert record.match([5, 6, 7, 8, 1, 2]) is None  # other tool output after the same reply
    assert record.match([5, 6, 7]) is None  # a context that ends inside the recorded reply
    assert record.match([5]) is None  # shorter than the record's prompt
