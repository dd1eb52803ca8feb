"""`gspo-ray data ...`: write generated tasks as files in the layouts users bring (docs/data.md).

    gspo-ray data make wordproblems --out runs/data/wordproblems     # verl parquet + TRL save_to_disk, train/test
"""
from __future__ import annotations

from pathlib import Path

import typer

data_app = typer.Typer(no_args_is_help=True, help="write generated tasks as data files")
TASKS = ("wordproblems",)


@data_app.command("make")
def data_make(task: str = typer.Argument(..., help="wordproblems"),
              out: Path = typer.Option(..., help="output directory"),
              num_train: int = typer.Option(4000, help="training problems"),
              num_eval: int = typer.Option(64, help="held-out problems (disjoint from training)"),
              seed: int = typer.Option(0, help="generator seed"),
              min_ops: int = typer.Option(2, help="fewest arithmetic operations a problem takes (2-3)"),
              max_ops: int = typer.Option(3, help="most arithmetic operations a problem takes (2-3)"),
              max_value: int = typer.Option(5, help="largest quantity in a problem"),
              instruction: str = typer.Option("reason", help="what each prompt asks for after the question: "
                                              "'reason' (step by step, then the answer line) or 'oneline' (one "
                                              "line of arithmetic, then the answer line)"),
              max_answer_share: float = typer.Option(0.04, help="the most of a split one answer value may take, "
                                                     "so that printing a frequent answer scores little")):
    """Write TASK's train and held-out splits as verl-layout parquet (OUT/train.parquet, OUT/test.parquet) and
    TRL-style `datasets` directories (OUT/trl/train, OUT/trl/test), then what a constant guess would score."""
    from gspo_ray.data.wordproblems import best_constant_guess, build_wordproblem_splits, write_wordproblems

    if task not in TASKS:
        typer.echo(f"error: task {task!r} unknown; valid: {', '.join(TASKS)}", err=True)
        raise typer.Exit(2)
    try:
        paths = write_wordproblems(out, num_train, num_eval, seed, min_ops, max_ops, max_value, instruction,
                                   max_answer_share)
    except ValueError as e:
        typer.echo(f"error: {' '.join(str(e).split())}", err=True)
        raise typer.Exit(2) from None
    for name, path in paths.items():
        typer.echo(f"{name:<11} {path}")
    splits = build_wordproblem_splits(num_train, num_eval, seed, min_ops, max_ops, max_value, max_answer_share)
    for split, problems in zip(("train", "test"), splits):  # the floor a policy that ignores the question reaches
        answer, share = best_constant_guess(problems)
        typer.echo(f"{split:<5} {len(problems)} problems; the best constant guess ({answer}) scores pass@1 {share:.3f}")
