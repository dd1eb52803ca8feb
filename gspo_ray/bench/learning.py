"""`gspo-ray bench --suite learn [--recipe R] [--seeds 0,1,2]`: a recipe learning its task, over seeds (tables + PNG).

Runs the recipe as it ships (its steps, eval schedule and early stop), once per seed with `seed=S` (which seeds the
engines' sampling) and `model.tiny.seed=S` when the model is built locally (so the init changes too); the prompts
and the held-out set stay those of the recipe's data seed. Reports:
- per seed: held-out greedy exact at each evaluation (for an environment's task, its share of held-out episodes
  solved, `eval/solved`: `--recipe gspo_ray/recipes/guess_moe.yaml`), the step at which it first reaches >= 0.95, the training
  time (sum of step times) and the job's wall time (pool start-up and evaluations included);
- over seeds: held-out exact at each evaluated step (mean and range) and the job seconds at which it was reached;
- the curves (held-out exact against job seconds and steps, one line per seed) as a PNG beside the table.
Learning curves are of the machine they ran on: CPU kernels differ between machines, and so do the paths of the
same seed.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from gspo_ray.bench.common import TINY_RECIPE, markdown_table

SOLVED = 0.95  # held-out exact that counts as solved


def learn_run(recipe: Path, seed: int, out_dir: Path, overrides: tuple[str, ...] = ()) -> dict:
    """One seeded job of `recipe`; returns its eval curve [(step, job seconds, exact, reward)] and summary."""
    from gspo_ray.config import load_config
    from gspo_ray.coordinator.job import run_job
    from gspo_ray.coordinator.tracking import read_metrics

    base = load_config(recipe)
    seeded = [f"seed={seed}"] + ([f"model.tiny.seed={seed}"] if base.model.tiny is not None else [])
    if base.model.packaged is not None:  # imported once where the recipe's own runs keep it, not per seed
        from gspo_ray.models.cache import packaged_model_dir
        from gspo_ray.models.gguf import ensure_imported

        model_dir = ensure_imported(packaged_model_dir(base.model.packaged, base.model.cache_dir))
        seeded += ["model.packaged=null", f"model.path={model_dir}"]
    cfg = load_config(recipe, [*seeded, f"logging.out_dir={out_dir}", f"name={base.name}-s{seed}",
                               "logging.progress=false", "logging.plot=false", "logging.tensorboard=false",
                               "logging.export_hf=none", *overrides])
    start = time.perf_counter()
    summary = run_job(cfg)
    if summary.interrupted:  # SIGTERM / Ctrl-C ends the bench, not only this seed's job
        raise SystemExit(summary.exit_code)
    wall = time.perf_counter() - start
    rows = read_metrics(summary.run_dir / "metrics.jsonl")
    curve = [(r["step"], r.get("time/job_s"), held_out_score(r), r["eval/reward"])
             for r in rows if "eval/reward" in r]
    solved = next(((s, t) for s, t, e, _ in curve if e >= SOLVED), (None, None))
    return {"seed": seed, "curve": curve, "solved_at": solved[0], "solved_job_s": solved[1],
            "train_s": sum(r.get("time/step_s") or 0.0 for r in rows), "wall_s": wall, "steps": summary.steps,
            "run_dir": str(summary.run_dir)}


def held_out_score(row: dict) -> float:
    """An evaluation row's held-out score: greedy exact for a task with answers, else the environment's share of
    episodes solved (absent while none is: 0)."""
    return row["eval/exact"] if "eval/exact" in row else row.get("eval/solved", 0.0)


def per_seed_table(runs: list[dict]) -> str:
    steps = sorted({s for r in runs for s, *_ in r["curve"]})
    rows = []
    for r in runs:
        exact = {s: e for s, _, e, _ in r["curve"]}
        rows.append({"seed": r["seed"], **{f"exact@{s}": exact.get(s) for s in steps},
                     f"exact>={SOLVED} at step": r["solved_at"], "at job s": r["solved_job_s"],
                     "train s": r["train_s"], "job wall s": r["wall_s"], "steps run": r["steps"]})
    return markdown_table(rows)


def over_seeds_table(runs: list[dict]) -> str:
    """Held-out exact and reward at each evaluated step over the seeds that reached it (an early-stopped seed keeps
    its last value: it stopped because it had solved the task)."""
    steps = sorted({s for r in runs for s, *_ in r["curve"]})
    rows = []
    for step in steps:
        at = [next((c for c in reversed(r["curve"]) if c[0] <= step), None) for r in runs]
        at = [c for c in at if c is not None]
        exact, reward = [c[2] for c in at], [c[3] for c in at]
        secs = [c[1] for c in at if c[0] == step and c[1] is not None]
        rows.append({"step": step, "held-out exact mean": statistics.mean(exact),
                     "range": f"{min(exact):.2f}-{max(exact):.2f}", "held-out reward mean": statistics.mean(reward),
                     "job s (mean of seeds evaluated here)": statistics.mean(secs) if secs else None})
    return markdown_table(rows)


def peer_runs(out: Path, name: str) -> list[dict]:
    """The peer's runs of the same recipe, when `make bench-trl ARGS="--recipe R --eval-every N --seed S"` wrote
    them (out/trl_<name>_s<S>.json, in learn_run's format plus "peer")."""
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"trl_{name}_s*.json"))]


def plot_curves(runs: list[dict], path: Path, title: str, peers: list[dict] = ()) -> Path:
    """Held-out exact against job seconds and steps: one solid line per seed, the peer's runs dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in [*runs, *peers]:
        label, style = (f"{r['peer']} seed {r['seed']}", "--") if "peer" in r else (f"seed {r['seed']}", "-")
        curve = [c for c in r["curve"] if c[1] is not None]
        by_time.plot([c[1] for c in curve], [c[2] for c in curve], style, marker="o", label=label)
        by_step.plot([c[0] for c in r["curve"]], [c[2] for c in r["curve"]], style, marker="o", label=label)
    clock = ("job seconds (gspo-ray: from the job's start, start-up and evaluations included; "
             f"{peers[0]['peer']}: from its trainer built, model load excluded)" if peers else
             "job seconds (start-up and evaluations included)")
    by_time.set(xlabel=clock, ylabel="held-out greedy exact", ylim=(-0.03, 1.03))
    by_step.set(xlabel="step", ylim=(-0.03, 1.03))
    by_step.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_learning_bench(recipe: Path = TINY_RECIPE, seeds: tuple[int, ...] = (0, 1, 2),
                       out: Path = Path("runs/bench")) -> str:
    from gspo_ray.config import load_config

    name = load_config(recipe).name
    with tempfile.TemporaryDirectory(prefix="bench-learn-") as tmp:
        runs = [learn_run(recipe, s, Path(tmp)) for s in seeds]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"learn_{name}.json").write_text(json.dumps(runs, indent=1))
    return learning_report(recipe, out)


def learning_report(recipe: Path, out: Path = Path("runs/bench")) -> str:
    """Tables and PNG from the saved runs (out/learn_<name>.json) and the peer's (out/trl_<name>_s*.json): what
    run_learning_bench prints, rebuilt without training, e.g. after more peer seeds were run."""
    from gspo_ray.config import load_config

    name = load_config(recipe).name
    runs = json.loads((out / f"learn_{name}.json").read_text())
    seeds = [r["seed"] for r in runs]
    peers = peer_runs(out, name)
    png = plot_curves(runs, out / f"learn_{name}.png", f"{name}: held-out greedy exact, seeds {seeds}", peers)
    text = (f"{name} ({recipe}), per seed (held-out greedy exact; solved = first exact >= {SOLVED})\n"
            f"{per_seed_table(runs)}\n\nover seeds {seeds}\n{over_seeds_table(runs)}\n\ncurves: {png}")
    if peers:
        text += (f"\n\n{peers[0]['peer']}, the same recipe (make bench-trl), per seed\n{per_seed_table(peers)}"
                 f"\n\nover its seeds {[p['seed'] for p in peers]}\n{over_seeds_table(peers)}")
    print(text, flush=True)
    return text


if __name__ == "__main__":  # python -m gspo_ray.bench.learning RECIPE: the report again, from runs/bench
    import sys

    learning_report(Path(sys.argv[1]))
