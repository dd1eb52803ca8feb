"""`gspo-ray bench` / `make bench`: per-phase time of a training step and steady-state samples/s, as a table.

Runs the tiny-MoE recipe for a few steps in each mode (sync / async x engine log-probs / recomputed) on one
local Ray instance and reports the mean over steady-state steps (the first steps, which include warm-up, are
skipped). Phases: rollout (generate + reward, waiting included), train (all optimizer steps of the batch),
sync (export + push + probe verification). Idle is the part of a step a pool is not working for it:
rollout idle = step - rollout wait (sync mode; in async mode the next batch samples during training),
trainer idle = step - train.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from gspo_ray.config import load_config
from gspo_ray.coordinator.tracking import read_metrics

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny_moe.yaml"
MODES = [("sync", False), ("async", False), ("sync", True), ("async", True)]
COLUMNS = ["step_s", "rollout_s", "train_s", "sync_s", "rollout_idle_s", "trainer_idle_s", "samples_per_s",
           "push_mb"]


def bench_mode(mode: str, recompute: bool, steps: int, out_dir: Path) -> dict[str, float]:
    from gspo_ray.coordinator.job import run_job

    cfg = load_config(RECIPE, [f"coordinator.mode={mode}", f"coordinator.recompute_old_logprobs={recompute}",
                               f"coordinator.steps={steps}", "coordinator.eval_every=0", "coordinator.checkpoint_every=0",
                               "data.num_eval=0", f"logging.out_dir={out_dir}", f"name=bench-{mode}-{recompute}",
                               "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
                               "coordinator.filter_zero_adv=false"])
    summary = run_job(cfg)
    rows = read_metrics(summary.run_dir / "metrics.jsonl")[2:] or read_metrics(summary.run_dir / "metrics.jsonl")
    mean = lambda key: sum(r.get(key) or 0.0 for r in rows) / len(rows)  # noqa: E731
    step, rollout, train = mean("time/step_s"), mean("time/rollout_s"), mean("time/train_s")
    samples = cfg.coordinator.prompts_per_step * cfg.rollout.group_size
    return {"step_s": step, "rollout_s": rollout, "train_s": train, "sync_s": mean("time/sync_s"),
            "rollout_idle_s": max(step - rollout, 0.0) if mode == "sync" else max(step - mean("rollout/gen_s"), 0.0),
            "trainer_idle_s": max(step - train, 0.0), "samples_per_s": samples / step,
            "push_mb": mean("sync/push_mb")}


def format_table(results: list[tuple[str, dict[str, float]]]) -> str:
    head = f"{'mode':<22}" + "".join(f"{c:>15}" for c in COLUMNS)
    lines = [head, "-" * len(head)]
    for name, r in results:
        lines.append(f"{name:<22}" + "".join(f"{r[c]:>15.3f}" for c in COLUMNS))
    return "\n".join(lines)


def run_bench(quick: bool = False) -> str:
    steps = 4 if quick else 10
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode, recompute in MODES:
            name = f"{mode}, {'recompute' if recompute else 'engine logp'}"
            results.append((name, bench_mode(mode, recompute, steps, Path(tmp))))
    table = format_table(results)
    print(f"tiny Qwen3-MoE, 16 prompts x 8 samples per step, mean over steps 3..{steps}\n" + table)
    return table
