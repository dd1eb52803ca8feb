"""`gspo-ray bench --suite moe-async`: GSPO without Routing Replay where it is hardest, async training with partial
rollouts, against R3 (the engine's routing, captured per token and replayed by the trainer).

    gspo-ray bench --suite moe-async [--seeds 0,1,2] [--steps N] [--quick]    (up to 500 steps a run; --quick: 4)

Each finished run is appended to `runs/bench/moe_async.jsonl`, and the tables and the plot are built from every run
there of the same step count: a long experiment can be split over sittings (seed 0 in one, seeds 1 and 2 in the
next) and read as one.

The model is `make run`'s tiny Qwen3-MoE widened to 16 experts top-2 (where routing moves by several per cent per
update, `--suite moe-tiny`), on its copy task at its lr (3e-4). Async mode with partial rollouts: a segment is 2
tokens of the 6 a completion may take, so most completions span 2-3 rounds, sampled by up to 3 policy versions
(stale_policy keep: each token anchored on its own sampling log-prob); 1 pass x 2 mini-batches per rollout batch (2 versions per step), old
log-probs from the engine (the sampling policy: the ratio itself corrects the staleness). Every run logs the routing
agreement by version lag (trainer.routing_agreement: the trainer's top-k against the engine's, per trained token).
R2 is not a variant: it records the trainer's first forward, which in async mode is not the sampling policy (the
config refuses it).

Per run: final and best held-out greedy reward (64 prompts, every 10 steps), collapses (final held-out below half
its best), skipped optimizer steps, token and sequence clip fractions, routing agreement at lag 0, 1 and 2+. Prints
the per-run table and the over-seed means, and writes a PNG of the training reward and the agreement by lag.
"""
from __future__ import annotations

import functools
import statistics
import tempfile
import time
from pathlib import Path

from gspo_ray.bench.common import TINY_RECIPE, optional_number, table_head
from gspo_ray.bench.moe_tiny import tiny_moe_model

LR, MINIBATCHES, EVAL_EVERY = 3e-4, 2, 10
VARIANTS = [  # (label, importance_sampling_level, routing_replay, extra overrides)
    ("GRPO", "token", "none", ()),
    ("GRPO + R3", "token", "R3", ()),
    ("GSPO", "sequence", "none", ()),
    ("GSPO + R3", "sequence", "R3", ()),
    ("GSPO eps auto", "sequence", "none", ("algorithm.eps=auto",)),
]
ASYNC_PARTIAL = ("coordinator.mode=async", "rollout.partial.segment_tokens=2", "rollout.partial.max_segments=3",
                 "rollout.partial.stale_policy=keep",
                 "coordinator.num_iterations=1", f"coordinator.num_minibatches={MINIBATCHES}",
                 "coordinator.filter_zero_adv=false", "trainer.routing_agreement=true", "trainer.router_churn_every=0",
                 f"trainer.lr={LR}", "data.num_eval=64", f"coordinator.eval_every={EVAL_EVERY}")
LAGS = ("lag0", "lag1", "lag2p")


def variant_config(label: str, level: str, replay: str, steps: int, seed: int, out_dir: Path,
                   extra: tuple[str, ...] = ()):
    """One variant's job config (validated as a job's is)."""
    from gspo_ray.bench.common import bench_cfg

    name = f"bench-moe-async-{label.replace(' ', '').replace('+', '-')}-s{seed}"
    return bench_cfg(out_dir, name, steps, *tiny_moe_model(), f"seed={seed}",
                     f"algorithm.importance_sampling_level={level}", f"trainer.routing_replay={replay}",
                     *ASYNC_PARTIAL, *extra, recipe=TINY_RECIPE)


def bench_async_variant(label: str, level: str, replay: str, steps: int, seed: int, out_dir: Path,
                        extra: tuple[str, ...] = ()) -> dict:
    from gspo_ray.coordinator.job import run_job
    from gspo_ray.coordinator.tracking import read_metrics

    cfg = variant_config(label, level, replay, steps, seed, out_dir, extra)
    start = time.time()
    summary = run_job(cfg)
    rows = [r for r in read_metrics(summary.run_dir / "metrics.jsonl") if r.get("step", 0) > 0]

    def mean(key: str) -> float | None:
        vals = [r[key] for r in rows if key in r]
        return statistics.fmean(vals) if vals else None
    evals = [r for _, r in summary.eval_history]
    return {"label": label, "seed": seed, "steps": len(rows),
            "eval_final": evals[-1] if evals else None, "eval_best": max(evals) if evals else None,
            "collapsed": bool(evals) and evals[-1] < 0.5 * max(evals),
            "skipped": (len(rows) * MINIBATCHES - rows[-1]["train/version"]) if rows else 0,
            "clip_tok": mean("train/clip_frac_tok"), "clip_seq": mean("train/clip_frac_seq"),
            "multi_version": mean("rollout/multi_version_samples"),
            **{f"agree_{lag}": _share(rows, lag) for lag in LAGS},
            # (token, layer) pairs per layer over the run (a row's sums are means over its optimizer steps)
            **{f"tokens_{lag}": sum(r.get(f"moe/route_agree_tokens_{lag}", 0.0) * r.get("train/optimizer_steps", 1)
                                    for r in rows) for lag in LAGS},
            "reward": [r.get("rollout/reward_mean") for r in rows], "wall_s": time.time() - start,
            "eval_history": [[step, value] for step, value in summary.eval_history]}


def append_result(path: Path, result: dict) -> None:
    """Keep one finished run (one JSON line), so sittings add up."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(result) + "\n")


def load_results(path: Path, steps: int) -> list[dict]:
    """Every kept run of `steps` steps, in the order they finished (a later run of the same variant and seed
    replaces an earlier one)."""
    import json

    if not path.exists():
        return []
    runs: dict[tuple[str, int], dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if r.get("requested_steps") == steps:
                runs.pop((r["label"], r["seed"]), None)
                runs[(r["label"], r["seed"])] = r
    return list(runs.values())


def _share(rows: list[dict], lag: str) -> float | None:
    """Agreement at `lag` over the whole run: (token, layer) pairs that agreed over pairs compared."""
    hits = sum(r.get(f"moe/route_agree_hits_{lag}", 0.0) for r in rows)
    tokens = sum(r.get(f"moe/route_agree_tokens_{lag}", 0.0) for r in rows)
    return hits / tokens if tokens > 0 else None


def format_async(results: list[dict]) -> str:
    head = ("| run | seed | steps | held-out reward final | best | solved at step | largest dip | collapsed | "
            "skipped steps | "
            "clip frac token | "
            "clip frac seq | samples spanning 2+ versions per step | routing agreement lag 0 | lag 1 | lag 2+ | "
            "tokens compared lag 0 / 1 / 2+ | s |")
    lines = table_head(head)
    for r in results:
        lines.append(f"| {r['label']} | {r['seed']} | {r['steps']} | {optional_number(r['eval_final'], 3)} | "
                     f"{optional_number(r['eval_best'], 3)} | {r['solved'] if 'solved' in r else solved_at(r)} | "
                     f"{optional_number(r['dip'] if 'dip' in r else largest_dip(r), 3)} | "
                     f"{'yes' if r['collapsed'] else 'no'} | {r['skipped']:.0f} | "
                     f"{optional_number(r['clip_tok'], 3)} | {optional_number(r['clip_seq'], 3)} | "
                     f"{optional_number(r['multi_version'], 1)} | "
                     + " | ".join(optional_number(r[f"agree_{lag}"], 3) for lag in LAGS) + " | "
                     + " / ".join(f"{r[f'tokens_{lag}']:.0f}" for lag in LAGS) + f" | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def summarise(results: list[dict]) -> list[dict]:
    """Each variant's mean over its seeds (collapses and skipped steps summed, the largest dip of any seed)."""
    out = []
    for label in dict.fromkeys(r["label"] for r in results):
        runs = [r for r in results if r["label"] == label]

        def m(key):
            vals = [r[key] for r in runs if r[key] is not None]
            return statistics.fmean(vals) if vals else None
        out.append({"label": label, "seed": f"{len(runs)} seeds", "steps": max(r["steps"] for r in runs),
                    **{k: m(k) for k in ("eval_final", "eval_best", "clip_tok", "clip_seq", "multi_version",
                                         *(f"agree_{lag}" for lag in LAGS), *(f"tokens_{lag}" for lag in LAGS),
                                         "wall_s")},
                    "collapsed": sum(r["collapsed"] for r in runs) > 0, "skipped": sum(r["skipped"] for r in runs),
                    "solved": _solved_summary([solved_at(r) for r in runs]),
                    "dip": max(largest_dip(r) for r in runs),
                    "reward": runs[0]["reward"]})
    return out


@functools.cache  # read the recipe once, not per table row
def solved_reward() -> float:
    """The held-out reward at which the tiny recipe's job stops, solved (its coordinator.early_stop_reward)."""
    from gspo_ray.config import load_config

    return load_config(TINY_RECIPE).coordinator.early_stop_reward


def solved_at(run: dict, threshold: float | None = None) -> int | str:
    """The first evaluated step whose held-out reward reached the early stop (the run ended there), or "-"."""
    threshold = solved_reward() if threshold is None else threshold
    return next((int(step) for step, value in run.get("eval_history", []) if value >= threshold), "-")


def largest_dip(run: dict) -> float:
    """The held-out reward's largest fall below its best so far (a collapse that recovered shows here, not in the
    final reward)."""
    best, dip = float("-inf"), 0.0
    for _, value in run.get("eval_history", []):
        best = max(best, value)
        dip = max(dip, best - value)
    return dip


def _solved_summary(steps: list[int | str]) -> str:
    done = [s for s in steps if s != "-"]
    return f"{len(done)} of {len(steps)}" + (f", mean step {statistics.fmean(done):.0f}" if done else "")


def held_out_mean(runs: list[dict]) -> dict[int, float]:
    """Step -> the held-out reward's mean over the runs, at the steps every run reached; a run the early stop ended
    (solved) counts at its last value after it stopped."""
    by_step: dict[int, list[float]] = {}
    last_step = max((int(s) for r in runs for s, _ in r.get("eval_history", [])), default=0)
    for r in runs:
        history = [(int(s), v) for s, v in r.get("eval_history", [])]
        if history and solved_at(r) != "-":
            step, value = history[-1]
            history += [(s, value) for s in range(step + EVAL_EVERY, last_step + 1, EVAL_EVERY)]
        for step, value in history:
            by_step.setdefault(step, []).append(value)
    return {step: statistics.fmean(v) for step, v in sorted(by_step.items()) if len(v) == len(runs)}


def plot_async(results: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, h, b) = plt.subplots(1, 3, figsize=(17, 4))
    for label in dict.fromkeys(r["label"] for r in results):
        runs = [r for r in results if r["label"] == label]
        n = min(len(r["reward"]) for r in runs)
        a.plot(range(1, n + 1), [statistics.fmean(r["reward"][i] or 0.0 for r in runs) for i in range(n)],
               label=f"{label} ({len(runs)} seeds)")
        held_out = held_out_mean(runs)
        h.plot(list(held_out), list(held_out.values()), marker=".", label=label)
        b.plot(range(len(LAGS)), [statistics.fmean(r[f"agree_{lag}"] or float("nan") for r in runs) for lag in LAGS],
               marker="o", label=label)
    a.set(xlabel="step (rollout batch; 2 updates each)", ylabel="mean training reward (0-2)", title="reward")
    b.set(xticks=range(len(LAGS)), xticklabels=["0", "1", "2+"], xlabel="versions between sampling and trainer",
          ylabel="trainer top-k == engine top-k", title="routing agreement by version lag")
    h.set(xlabel="step", ylabel="greedy held-out reward (0-2), mean over seeds", title="held-out reward")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_moe_async_bench(steps: int = 500, seeds: tuple[int, ...] = (0, 1, 2),
                        png: Path = Path("runs/bench_moe_async.png"),
                        results_path: Path = Path("runs/bench/moe_async.jsonl")) -> list[dict]:
    from gspo_ray.bench.common import bench_cfg
    from gspo_ray.coordinator.job import init_ray, shutdown_ray

    results = []
    with tempfile.TemporaryDirectory(prefix="gspo-bench-moe-async-") as tmp:
        head = init_ray(bench_cfg(Path(tmp), "ray", 1))  # one Ray for every run: each job joins it
        try:
            for seed in seeds:
                for label, level, replay, extra in VARIANTS:
                    try:
                        results.append(bench_async_variant(label, level, replay, steps, seed, Path(tmp), extra))
                        results[-1]["requested_steps"] = steps
                        append_result(results_path, results[-1])
                    except Exception as e:  # a failed run is reported, the others still run
                        print(f"| {label} | {seed} | failed: {type(e).__name__}: {e} |", flush=True)
                        continue
                    print(format_async(results[-1:]).splitlines()[-1], flush=True)
        finally:
            shutdown_ray(head)
    if not results:
        return results
    results = load_results(results_path, steps)  # this sitting's runs and any earlier sitting's of the same length
    png.parent.mkdir(parents=True, exist_ok=True)
    plot_async(results, png)
    print(f"make run's tiny Qwen3-MoE widened to 16 experts top-2, copy task, 16 prompts x 8, lr {LR:g}, async, "
          f"partial rollouts of 2-token segments (up to 3), 1 pass x {MINIBATCHES} mini-batches, engine log-probs as "
          f"the anchor, {steps} steps per run\n" + format_async(results) + "\n\nover seeds\n"
          + format_async(summarise(results)) + f"\nplot: {png}", flush=True)
    return results
