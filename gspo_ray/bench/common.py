"""What every benchmark shares: the packaged recipes and a job config stripped to what a timing run needs."""
from __future__ import annotations

from pathlib import Path

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
TINY_RECIPE = RECIPES / "tiny_moe.yaml"
SMOLLM2_RECIPE = RECIPES / "smollm2_repeat.yaml"


def bench_cfg(out_dir: Path, name: str, steps: int, *overrides: str, recipe: Path = TINY_RECIPE):
    """A recipe (default the tiny-MoE one) for `steps` steps, without eval, checkpoints or extra outputs, in sync
    mode with the level's fixed clip band unless `overrides` say otherwise (the tiny recipe itself runs async
    with eps auto: the tables compare against the on-policy baseline)."""
    # imported here, not above: the table helpers below must import with torch alone (gpu_check on a bare GPU
    # machine has no pydantic)
    from gspo_ray.config import load_config

    return load_config(recipe, ["coordinator.mode=sync", "algorithm.eps=fixed",
                                f"coordinator.steps={steps}", "coordinator.eval_every=0",
                                "coordinator.checkpoint_every=0", "data.num_eval=0", f"logging.out_dir={out_dir}",
                                f"name={name}", "logging.progress=false", "logging.tensorboard=false",
                                "logging.plot=false", *overrides])


def table_head(head: str) -> list[str]:
    """A Markdown table's header row (written out in full) and its separator line."""
    return [head, "|---" * (head.count("|") - 1) + "|"]


def optional_number(x: float | None, digits: int) -> str:
    """`x` to `digits` decimals, or "-" where there is no value (a metric a variant does not measure)."""
    return "-" if x is None else f"{x:.{digits}f}"


def markdown_table(rows: list[dict]) -> str:
    """Rows of equal keys as a Markdown table: floats to 3 decimals, None as "-"."""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join("-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
                                       for v in r.values()) + " |")
    return "\n".join(lines)
