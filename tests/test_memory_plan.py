"""`gspo-ray plan` and the preflight's memory check, on weights-free model directories (config.json + tokenizer).

* the GPU reader's 16-GPU Qwen3-30B-A3B job (8 trainer ranks at TP 2 x EP 4, bf16, 80 GiB devices, 16k-token
  completions; shared/reviews/gpu-read-2026-12-07.md, finding 1) is refused by `config validate` in one line: exit
  2, the per-rank GiB, the largest term, a layout that fits, and that layout does fit;
* `gspo-ray plan` prints the terms and fitting layouts for it, with step times;
* a job that fits passes `config validate` without weights, saying they were not checked; `train`'s preflight
  still needs them.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import yaml
from typer.testing import CliRunner

from gspo_ray.cli.main import app

QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
                 "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "tie_word_embeddings": False, "max_position_embeddings": 40960,
                 "rope_theta": 1000000.0, "rms_norm_eps": 1e-06}


def weightless_dir(root, name: str, config: dict):
    from gspo_ray.models.tiny import build_tokenizer

    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    build_tokenizer().save_pretrained(path)
    return path


def job_file(root, model, **trainer) -> str:
    job = {"name": "plan-test", "model": {"path": str(model)}, "data": {"source": "builtin", "task": "repeat"},
           "logging": {"out_dir": str(root / "runs")},
           "rollout": {"num_workers": 4, "num_gpus_per_worker": 2, "tensor_parallel_size": 2, "group_size": 8,
                       "max_new_tokens": 16384, "max_model_len": 18432},
           "trainer": {"num_workers": 8, "tp": 2, "ep": 4, "num_gpus_per_worker": 1, "dtype": "bfloat16",
                       "micro_batch_tokens": 32768, "device_memory_gb": 80, **trainer},
           "coordinator": {"prompts_per_step": 64}}
    out = root / "job.yaml"
    out.write_text(yaml.safe_dump(job))
    return str(out)


@pytest.fixture(scope="module")
def q30(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    return root, weightless_dir(root, "qwen3-30b-a3b", QWEN3_30B_A3B)


def test_review_job_is_refused_with_a_layout_that_fits(q30):
    from gspo_ray.config import load_config
    from gspo_ray.preflight.memory import job_memory_plan
    from gspo_ray.trainer.layout_plan import USABLE_SHARE
    from gspo_ray.trainer.memory import rank_memory

    root, model = q30
    result = CliRunner().invoke(app, ["config", "validate", job_file(root, model)])
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: trainer memory: "), err
    gib = float(re.search(r"memory: ([\d.]+) GiB a rank", err).group(1))
    assert gib > 80 and "largest term activations" in err, err
    fit = re.search(r"fits: TP (\d+) x EP (\d+)(?: x CP (\d+))?(?: x PP (\d+))? \(DP \d+\), recompute (\w+), "
                    r"micro_batch_tokens (\d+)(, optimizer offload)? \(([\d.]+) GiB", err)
    assert fit, err
    tp, ep, cp, pp, recompute, tokens, offload, _ = fit.groups()
    fixed = load_config(job_file(root, model, tp=int(tp), ep=int(ep), recompute=recompute,
                                 micro_batch_tokens=int(tokens), optimizer_cpu_offload=bool(offload)))
    plan = job_memory_plan(fixed, QWEN3_30B_A3B)  # what the preflight's memory check decides on
    # CP / PP as suggested, set on the plan's layout (the config's cp / pp fields are checked by their own tests)
    layout = replace(plan.layout, cp=int(cp or 1), pp=int(pp or 1))
    assert rank_memory(plan.shape, layout).total <= USABLE_SHARE * plan.device_bytes and plan.hard


def test_the_plan_offers_only_layouts_the_job_could_run_at(q30):
    """At the defaults an MoE records routing drift and router churn, which the preflight refuses under CP, and a
    GPU pool pushes by nccl, which it refuses under PP: the plan offers neither (the memory alone would offer
    both); with those off it offers both."""
    from gspo_ray.config import load_config
    from gspo_ray.preflight.memory import job_memory_plan

    root, model = q30
    plan = job_memory_plan(load_config(job_file(root, model)), QWEN3_30B_A3B)
    offered = plan.fitting(100)
    assert offered and all(lay.cp == lay.pp == 1 for lay, _ in offered), [lay.describe() for lay, _ in offered]
    by_memory = [lay for lay, _ in replace(plan, accepts=None).fitting(100)]
    assert any(lay.cp > 1 for lay in by_memory) and any(lay.pp > 1 for lay in by_memory)
    free = load_config(job_file(root, model, routing_drift=False, router_churn_every=0),
                       ["rollout.weight_transfer=object_store"])
    offered = [lay for lay, _ in job_memory_plan(free, QWEN3_30B_A3B).fitting(200)]
    assert any(lay.cp > 1 for lay in offered) and any(lay.pp > 1 for lay in offered)


def test_plan_prints_terms_and_fitting_layouts(q30):
    root, model = q30
    result = CliRunner().invoke(app, ["plan", job_file(root, model), "--gpus", "16", "--gpu-memory", "80"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "weights: no weights: not checked" in out and "16 trainer ranks" in out
    for term in ("weights", "main_params", "grads", "optimizer", "activations", "logits", "total"):
        assert re.search(rf"^\s+{term}\s+[\d.]+ GiB", out, re.M), term
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\w+) \| (\d+) \| (\w+) \| (?:fp32|bf16) \| ([\d.]+) \| "
                      r".* \| ([\d.]+) \|$", out, re.M)
    assert rows and all(float(r[7]) <= 80 for r in rows), out
    assert [float(r[8]) for r in rows] == sorted(float(r[8]) for r in rows)  # cheapest first


def test_weights_free_directory_validates_and_train_needs_weights(tmp_path):
    from gspo_ray.config import load_config
    from gspo_ray.preflight import run_preflight
    from gspo_ray.preflight.model import PreflightError

    small = dict(QWEN3_30B_A3B, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                 vocab_size=22)
    model = weightless_dir(tmp_path, "small", small)
    job = job_file(tmp_path, model, num_workers=1, tp=1, ep=1, num_gpus_per_worker=0, dtype="float32",
                   micro_batch_tokens=256, device_memory_gb=None)
    overrides = ["rollout.num_workers=1", "rollout.num_gpus_per_worker=0", "rollout.tensor_parallel_size=1",
                 "rollout.max_new_tokens=16", "rollout.max_model_len=128"]
    result = CliRunner().invoke(app, ["config", "validate", job, *overrides])
    assert result.exit_code == 0, result.output
    assert "weights not checked" in result.stdout and re.search(r"memory\s+ok", result.stdout), result.stdout
    with pytest.raises(PreflightError, match="no weights"):
        run_preflight(load_config(job, overrides))
