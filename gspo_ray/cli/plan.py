"""`gspo-ray plan JOB.yaml [--gpus N] [--gpu-memory GIB]`: the trainer's memory per rank, term by term, for the
job's layout, and the cheapest layouts that fit (preflight/memory.py, trainer/memory.py; docs/scale.md, "Memory").

Reads the job file and the model's config.json (weights not needed: a directory with config.json is enough, and
the output says the weights were not checked). --gpus: trainer ranks (default trainer.num_workers); --gpu-memory:
GiB one rank may use (default trainer.device_memory_gb, else the GPU's, else a CPU pool's share of this host).
Nothing is built, nothing imported of Ray, vLLM or Megatron.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

plan_app = typer.Typer()


def model_config(cfg) -> tuple[dict, str]:
    """(config.json, what was checked of the weights) of the job's model.path."""
    from gspo_ray.preflight.model import PreflightError, read_config_json

    if cfg.model.path is None:
        raise PreflightError("model.path: gspo-ray plan reads the model's config.json; model.tiny and "
                             "model.packaged jobs have none to read yet")
    path = Path(cfg.model.path)
    hf = read_config_json(path)
    weights = sorted(path.glob("*.safetensors"))
    return hf, (f"{len(weights)} safetensors file(s), not read" if weights else "no weights: not checked")


@plan_app.command()
def plan(file: Path, overrides: list[str] = typer.Argument(None, help="key.path=value overrides"),
         gpus: Optional[int] = typer.Option(None, "--gpus", min=1, help="trainer ranks (default "
                                            "trainer.num_workers)"),
         gpu_memory: Optional[float] = typer.Option(None, "--gpu-memory", min=0.1, help="GiB one trainer rank "
                                                    "may use (default trainer.device_memory_gb, else detected)"),
         top: int = typer.Option(5, help="how many fitting layouts to list")):
    """Per-rank trainer memory of a job, term by term, and the cheapest layouts that fit (step time by the scale
    model); exit 2 with one line when the job file or its model cannot be read."""
    from gspo_ray.cli.errors import user_errors
    from gspo_ray.config import load_config
    from gspo_ray.preflight.memory import job_memory_plan
    from gspo_ray.trainer.memory import GIB

    with user_errors():
        cfg = load_config(file, overrides or [])
        hf, weights = model_config(cfg)
        p = job_memory_plan(cfg, hf, world=gpus, device_gib=gpu_memory)
    s = p.shape
    typer.echo(f"model   {cfg.model.path}: {s.name}, {s.total_params / 1e9:.2f} B parameters ({s.expert_params / 1e9:.2f} "
               f"B in experts), {s.layers} layers, hidden {s.hidden}; weights: {weights}")
    typer.echo(f"layout  {p.layout.world} trainer ranks, {p.layout.describe()}, {p.layout.dtype}, distributed "
               f"optimizer {'on' if p.layout.distributed else 'off'}")
    device = "unknown" if p.device_bytes is None else f"{p.device_bytes / GIB:.1f} GiB"
    typer.echo(f"device  {device} ({p.device_source})")
    stage = f" (pipeline stage {p.terms.stage}, the busiest of {p.layout.pp})" if p.layout.pp > 1 else ""
    typer.echo(f"per-rank memory{stage}:\n" + p.terms.table())
    step = p.step_s()
    verdict = "fits" if p.fits else "DOES NOT FIT"
    typer.echo(f"-> {verdict}; predicted step {step:.1f} s (the scale model: {p.batch_tokens / 1e6:.2f} M tokens a "
               "step at full length, H100 bf16 x 40% MFU)")
    if p.device_bytes is None:
        return
    fits = p.fitting(top)
    if not fits:
        typer.echo(f"no layout of {p.layout.world} ranks fits (TP, EP, CP, PP, recompute, micro_batch_tokens, "
                   "offload, gradient buffers): more ranks")
        return
    typer.echo(f"cheapest layouts that fit 90% of {p.device_bytes / GIB:.1f} GiB on {p.layout.world} ranks:")
    typer.echo("| TP | EP | CP | PP | recompute | micro_batch_tokens | offload | grad buffers | GiB a rank | largest term "
               "| step s |")
    typer.echo("|---|---|---|---|---|---|---|---|---|---|---|")
    for layout, terms in fits:
        name, size = terms.largest()
        typer.echo(f"| {layout.tp} | {layout.ep} | {layout.cp} | {layout.pp} | {layout.recompute} | "
                   f"{layout.micro_batch_tokens} | "
                   f"{'yes' if layout.offload else 'no'} | {'bf16' if layout.bf16_grads else 'fp32'} | {terms.total / GIB:.1f} | {name} {size / GIB:.1f} | "
                   f"{p.step_s(layout):.1f} |")
