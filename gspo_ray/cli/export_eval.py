"""`gspo-ray export` and `gspo-ray eval`: a trained policy out as a HF model, and scored on held-out data.

    gspo-ray export runs/my-run --out my-model [--dtype bfloat16]
    gspo-ray eval runs/my-run --data test.jsonl [--reward module:fn] [--n 8 --temperature 1.0] [--out samples.jsonl]
    gspo-ray eval runs/my-run                      # the run's own held-out prompts, as the in-training eval scored
    gspo-ray eval MODEL_DIR --config recipe.yaml   # those prompts before training
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

model_app = typer.Typer(no_args_is_help=True)
USER_ERRORS = (FileNotFoundError, ValueError)  # a wrong path, a bad flag or data row: one line, exit 2


def _fail(e: Exception) -> None:
    typer.echo(f"error: {' '.join(str(e).split())}", err=True)
    raise typer.Exit(2)


@model_app.command()
def export(path: Path = typer.Argument(..., help="run directory (latest checkpoint), checkpoints/step_N, or a "
                                                 "trainer checkpoint directory"),
           out: Path = typer.Option(..., help="HF model directory to write"),
           dtype: Optional[str] = typer.Option(None, help="float32 | bfloat16 | float16 (default: training dtype)"),
           model_dir: Optional[Path] = typer.Option(None, help="the HF model the run trained from (default: from "
                                                               "the run's config.yaml)"),
           overwrite: bool = typer.Option(False, help="replace --out if it exists"),
           merge: bool = typer.Option(False, help="LoRA runs: write the merged HF model instead of the PEFT "
                                                  "adapter directory")):
    """Write a checkpoint as a HF model directory (safetensors, config, tokenizer, chat template, generation
    config), from whatever DP/TP/EP layout it was trained with. transformers, vLLM and lm-eval load it. A LoRA
    run gives a PEFT adapter directory (adapter_config.json + adapter_model.safetensors; --merge: the merged
    model)."""
    from gspo_ray.coordinator.export import export_hf

    if out.exists() and any(out.iterdir()) and not overwrite:
        _fail(FileExistsError(f"--out {out} exists and is not empty; pass --overwrite to replace it"))
    try:
        written = export_hf(path, out, dtype=dtype, model_dir=model_dir, merge=merge)
    except USER_ERRORS as e:
        _fail(e)
    files = sorted(p.name for p in written.iterdir())
    typer.echo(f"wrote {written}: {', '.join(files)}")


@model_app.command("eval")
def eval_cmd(model: Path = typer.Argument(..., help="HF model directory, run directory, checkpoints/step_N or "
                                                    "trainer checkpoint"),
             data: Optional[Path] = typer.Option(None, help="JSONL of prompts (and references), one object per line "
                                                 "(default: the job's held-out prompts: the built-in task's eval "
                                                 "split or data.eval_path)"),
             reward: Optional[str] = typer.Option(None, help="reward function module:fn (default: the run's)"),
             reward_kwargs: Optional[str] = typer.Option(None, help="JSON object of reward keyword arguments"),
             n: int = typer.Option(1, min=1, help="samples per prompt"),
             temperature: Optional[float] = typer.Option(None, help="default: 0 (greedy) for n=1, else the run's"),
             max_new_tokens: Optional[int] = typer.Option(None, help="default: the run's rollout.max_new_tokens"),
             max_model_len: Optional[int] = typer.Option(None, help="default: the run's rollout.max_model_len"),
             prompt_field: Optional[str] = typer.Option(None, help="default: the run's data.prompt_field"),
             reference_field: Optional[str] = typer.Option(None, help="default: the run's data.reference_field"),
             chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="apply the chat template "
                                                 "(default: the run's data.apply_chat_template)"),
             pass_threshold: float = typer.Option(1.0, help="a sample passes when its reward's `exact` is 1, or "
                                                  "(no `exact`) its reward >= this"),
             config: Optional[Path] = typer.Option(None, help="job YAML to take defaults from (default: the run's)"),
             model_dir: Optional[Path] = typer.Option(None, help="the HF model a bare checkpoint trained from"),
             out: Optional[Path] = typer.Option(None, help="per-sample JSONL (default: <run_dir>/eval/cli_<data "
                                                "name>_step_N.jsonl when MODEL is in a run directory, else "
                                                "eval-<data name>.jsonl here)")):
    """Generate with vLLM and score with the training reward; print mean reward, pass@1, pass@n, mean length and
    finish reasons; write one JSON line per sample (and a .summary.json)."""
    from gspo_ray.coordinator.eval_run import EvalOptions, evaluate_model
    from gspo_ray.coordinator.evaluation import describe_eval
    from gspo_ray.envs.plugins import PluginError

    try:
        kwargs = json.loads(reward_kwargs) if reward_kwargs is not None else None
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError("--reward-kwargs must be a JSON object")
        opts = EvalOptions(data=data, reward=reward, reward_kwargs=kwargs, n=n, temperature=temperature,
                           max_new_tokens=max_new_tokens, max_model_len=max_model_len, prompt_field=prompt_field,
                           reference_field=reference_field, chat=chat, pass_threshold=pass_threshold,
                           config=config, model_dir=model_dir)
        result, written = evaluate_model(model, opts, out)
    except (*USER_ERRORS, PluginError) as e:
        _fail(e)
    summary = json.loads(written.with_suffix(".summary.json").read_text())
    step = f" (checkpoint step {summary['step']})" if summary["step"] is not None else ""
    typer.echo(f"model        {summary['model']}{step}\ndata         {summary['data']}")
    typer.echo(describe_eval(result.metrics))
    typer.echo(f"samples      {written} (summary: {written.with_suffix('.summary.json')})")
