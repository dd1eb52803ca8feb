"""`gspo-ray bench --suite learn`: the default recipe learning its task to solution, over seeds (a table).

The tiny-MoE copy recipe (`make run`) as it ships (async, eps auto, early stop at held-out greedy reward 1.95),
once per seed with `seed=S model.tiny.seed=S`: held-out greedy exact at fixed steps, the step at which it first
reaches exact >= 0.95, and the training time (sum of step times) and wall time. Learning curves are of the
machine they ran on: CPU kernels differ between machines, and so do the paths of the same seed.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from gspo_ray.bench.common import TINY_RECIPE, markdown_table

CHECKPOINT_STEPS = (0, 100, 200, 300)


def learn_run(seed: int, out_dir: Path, max_steps: int = 600) -> dict:
    from gspo_ray.config import load_config
    from gspo_ray.coordinator.job import run_job
    from gspo_ray.coordinator.tracking import read_metrics

    cfg = load_config(TINY_RECIPE, [f"seed={seed}", f"model.tiny.seed={seed}", f"coordinator.steps={max_steps}",
                                    f"logging.out_dir={out_dir}", f"name=learn-s{seed}", "logging.progress=false",
                                    "logging.plot=false", "logging.tensorboard=false", "logging.export_hf=none"])
    start = time.perf_counter()
    summary = run_job(cfg)
    wall = time.perf_counter() - start
    rows = read_metrics(summary.run_dir / "metrics.jsonl")
    exact = {r["step"]: r["eval/exact"] for r in rows if "eval/exact" in r}
    solved = next((s for s, e in sorted(exact.items()) if e >= 0.95), None)
    return {"seed": seed, **{f"exact@{s}": exact.get(s) for s in CHECKPOINT_STEPS}, "solved_at": solved,
            "train_s": sum(r.get("time/step_s") or 0.0 for r in rows), "wall_s": wall, "steps": summary.steps}


def run_learning_bench(seeds: tuple[int, ...] = (0, 1, 2)) -> str:
    with tempfile.TemporaryDirectory(prefix="bench-learn-") as tmp:
        table = markdown_table([learn_run(s, Path(tmp)) for s in seeds])
    print("make run's recipe to solution, per seed (held-out greedy exact; solved = first exact >= 0.95)")
    print(table, flush=True)
    return table
