"""In-job trainer recovery, measured: per seed, a tiny-recipe run with trainer rank 0 SIGKILLed after step k, against
the same run uninterrupted (`gspo-ray bench --suite recovery [--seeds 0,1,2]`).

Prints, per seed, how long the recovery took (pool rebuilt, checkpoint restored, weights pushed), how many steps
were replayed (at most `checkpoint_every`), the wall time each run took and both runs' rollout reward over their
last steps (the replayed steps sample afresh, so the killed run is another draw, read against the seeds'
spread). Everything a
user loses to a trainer death is those replayed steps' compute plus the recovery seconds: an in-memory snapshot
every step would save only the replay, which on the tiny recipe costs ~0.2 s a step against a rebuild of tens of
seconds (see the printed numbers), so it is not worth its memory and per-step copy.
"""
from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

LAST = 10  # the rollout reward is read as its mean over the last LAST steps: one step's batch is too noisy


def _run(out: Path, name: str, steps: int, checkpoint_every: int, kill_at: int | None,
         seed: int = 0) -> tuple[float, list[dict]]:
    import ray

    from gspo_ray.config import load_config
    from gspo_ray.coordinator.job import run_job
    from gspo_ray.coordinator.tracking import read_metrics

    cfg = load_config("gspo_ray/recipes/tiny_moe.yaml", [
        f"logging.out_dir={out}", "logging.progress=false", "logging.plot=false", "logging.tensorboard=false",
        f"coordinator.steps={steps}", f"coordinator.checkpoint_every={checkpoint_every}", "coordinator.eval_every=0",
        "data.num_eval=0", "coordinator.early_stop_reward=null", f"name={name}", f"seed={seed}"])
    pending = {kill_at} if kill_at else set()

    def hook(coord, step):
        if step in pending:
            pending.discard(step)
            pid = ray.get(coord.trainer.workers[0].__ray_call__.remote(lambda self: os.getpid()))
            os.kill(pid, signal.SIGKILL)

    t0 = time.perf_counter()
    run_job(cfg, after_step=hook)
    return time.perf_counter() - t0, read_metrics(cfg.run_dir / "metrics.jsonl")


def run_recovery_bench(steps: int = 60, kill_at: int = 25, checkpoint_every: int = 10,
                       seeds: tuple[int, ...] = (0, 1)) -> list[dict]:
    """Per seed, the killed run and the uninterrupted one, in alternating order (the first run of a seed pays the
    cold caches: seed 0 killed first, seed 1 clean first, ...); prints and returns one row per seed. The clean runs
    of the other seeds give the run-to-run spread the killed run's final metrics are read against."""
    from gspo_ray.bench.common import markdown_table

    rows = []
    with tempfile.TemporaryDirectory(prefix="gspo-recovery-") as tmp:
        for i, seed in enumerate(seeds):
            runs = {}
            for kind in (("killed", "clean") if i % 2 == 0 else ("clean", "killed")):
                runs[kind] = _run(Path(tmp), f"recovery-{kind}-s{seed}", steps, checkpoint_every,
                                  kill_at if kind == "killed" else None, seed)
            (killed_s, killed), (clean_s, clean) = runs["killed"], runs["clean"]
            rec = next(r for r in killed if "job/trainer_restarts" in r)
            row = {"seed": seed, "recovery s": rec["job/recovery_s"], "pool rebuild s": rec["job/recovery_pool_s"],
                   "steps replayed": int(rec["job/steps_replayed"]), "killed wall s": killed_s,
                   "clean wall s": clean_s, "first run": "killed" if i % 2 == 0 else "clean"}
            for label, rows_ in (("killed", killed), ("clean", clean)):
                row[f"reward, last {LAST} steps, {label}"] = sum(r["rollout/reward_mean"] for r in rows_[-LAST:]) / LAST
            if not killed[-1]["train/version"] == clean[-1]["train/version"] == steps:
                raise RuntimeError(f"seed {seed}: a run ended before step {steps}")
            rows.append(row)
    print(f"trainer rank 0 SIGKILLed after step {kill_at} of {steps} (checkpoint_every {checkpoint_every}), tiny "
          f"recipe; the killed run against the uninterrupted one of the same seed (the seeds' clean runs give the "
          f"run-to-run spread)")
    print(markdown_table(rows), flush=True)
    return rows
