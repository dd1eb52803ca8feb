"""`gspo-ray bench --suite moe-tiny`: the MoE experiment where routing really moves, over seeds, minutes a run.

    gspo-ray bench --suite moe-tiny [--seeds 0,1,2] [--quick]    (40 steps a run; --quick: 5)

`--suite moe` (SmolLM2 upcycled to 4 experts, lr 1e-5) moves 0.3-0.4% of the top-k choices per update: replay has
nothing to repair there. The regime probe (`--suite regime`) puts the GSPO paper's ~10% at 8 experts and lr 1e-4,
on a 0.7B model that 2 cores train at about one update a minute: hundreds of updates over five variants and three
seeds are out of reach. This suite runs the experiment on the model `make run` trains from scratch (a locally built
Qwen3-MoE: 2 layers, hidden 64, random init), widened to 16 experts top-2, on its copy task at its lr (3e-4): there
routing moves by several per cent per update (the table's first drift column says how much, per run).

Five variants per seed: GRPO (token ratios, no replay), GRPO + R2 (replaying the sampling policy's routing), GSPO,
GSPO-token, and GSPO with eps auto. Every rollout batch (16 prompts x 8) is reused 2 passes x 4 mini-batches = 8
updates, old log-probs recomputed by the trainer, so drift and R2 compare with the sampling policy exactly.
Per run: drift after k updates, the routing-induced log-ratio and the clips it alone caused, clip fractions, the
training reward per step, the held-out greedy reward before and after, grad-norm peaks and skipped steps. Printed:
the per-run table (`moe.format_moe`), an over-seed summary, and a PNG of the reward curves.
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from gspo_ray.bench.common import TINY_RECIPE, optional_number, table_head
from gspo_ray.bench.moe import MINIBATCHES, PASSES, bench_moe_variant, format_moe

EXPERTS, TOP_K, LR = 16, 2, 3e-4  # the reuse shape, 2 passes x 4 mini-batches, is moe's
VARIANTS = [  # (label, importance_sampling_level, routing_replay, extra overrides)
    ("GRPO", "token", "none", ()),
    ("GRPO + R2", "token", "R2", ()),
    ("GSPO", "sequence", "none", ()),
    ("GSPO-token", "sequence_token", "none", ()),
    ("GSPO eps auto", "sequence", "none", ("algorithm.eps=auto",)),
]


def tiny_moe_model(experts: int = EXPERTS, top_k: int = TOP_K) -> tuple[str, ...]:
    """The overrides that widen make run's tiny Qwen3-MoE to `experts` experts, top-`top_k`."""
    return f"model.tiny.experts={experts}", f"model.tiny.top_k={top_k}"


def _window_mean(values: list, n: int, last: bool) -> float:
    vals = [v for v in (values[-n:] if last else values[:n]) if v is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def _mean_and_range(xs: list[float]) -> tuple[float, float, float]:
    return statistics.fmean(xs), min(xs), max(xs)


def summarise(results: list[dict]) -> list[dict]:
    """One row per variant over its seeds: means, with the seeds' range where it says something."""
    rows = []
    for label in dict.fromkeys(r["label"] for r in results):
        runs = [r for r in results if r["label"] == label]
        last_reward = [_window_mean(r["reward"], 5, last=True) for r in runs]
        eval_end = [r["eval"][-1][1] for r in runs if r["eval"]]
        rows.append({
            "label": label, "seeds": len(runs),
            "updates": sum(r["steps"] for r in runs) // len(runs) * len(runs[0]["drift_at"]),  # per run
            "drift_1": statistics.fmean(r["drift_at"][1] for r in runs),
            "drift_all": statistics.fmean(r["drift"] for r in runs),
            "noise_d": (statistics.fmean(r["noise_d"] for r in runs) if runs[0].get("noise_d") is not None
                        else None),
            "tok_removed": (statistics.fmean(r["noise_tok_removed"] for r in runs)
                            if runs[0].get("noise_tok_removed") is not None else None),
            "seq_removed": (statistics.fmean(r["noise_seq_removed"] for r in runs)
                            if runs[0].get("noise_seq_removed") is not None else None),
            "clip_tok": statistics.fmean(r["clip_tok"] for r in runs),
            "clip_seq": statistics.fmean(r["clip_seq"] for r in runs),
            "reward_first": statistics.fmean(_window_mean(r["reward"], 5, last=False) for r in runs),
            "reward_last": _mean_and_range(last_reward),
            "eval_end": _mean_and_range(eval_end) if eval_end else None,
            "grad_norm_peak": max(max(r["grad_norm"]) / statistics.median(r["grad_norm"]) for r in runs),
            "skipped": max(r["skipped"] for r in runs),
            "wall_s": statistics.fmean(r["wall_s"] for r in runs),
        })
    return rows


def _span(x) -> str:
    return "-" if x is None else f"{x[0]:.3f} ({x[1]:.3f}-{x[2]:.3f})"


def format_summary(rows: list[dict]) -> str:
    head = ("| run | seeds | updates per run | drift after 1 update | drift, all updates (1..N) | routing-induced mean abs "
            "log-ratio | GRPO clips routing alone caused | GSPO clips routing alone caused | clip frac token | "
            "clip frac seq | training reward, first 5 steps | last 5 steps: mean (range) | held-out greedy reward "
            "at the end: mean (range) | grad-norm peak / median | skipped steps | s per run |")
    lines = table_head(head)
    for r in rows:
        lines.append(f"| {r['label']} | {r['seeds']} | {r['updates']} | {r['drift_1']:.4f} | {r['drift_all']:.4f} | "
                     f"{optional_number(r['noise_d'], 4)} | {optional_number(r['tok_removed'], 3)} | "
                     f"{optional_number(r['seq_removed'], 3)} | "
                     f"{r['clip_tok']:.3f} | {r['clip_seq']:.3f} | {r['reward_first']:.3f} | "
                     f"{_span(r['reward_last'])} | {_span(r['eval_end'])} | {r['grad_norm_peak']:.1f} | "
                     f"{r['skipped']:.0f} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def plot_rewards(results: list[dict], path: Path) -> Path:
    """Training reward per step, each variant's mean over seeds with its seeds' range shaded; drift vs reuse."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    for label in dict.fromkeys(r["label"] for r in results):
        runs = [r for r in results if r["label"] == label]
        n = min(len(r["reward"]) for r in runs)
        steps = range(1, n + 1)
        per_step = [[r["reward"][i] for r in runs if r["reward"][i] is not None] for i in range(n)]
        mean = [statistics.fmean(v) if v else float("nan") for v in per_step]
        line, = a.plot(steps, mean, label=f"{label} ({len(runs)} seeds)")
        a.fill_between(steps, [min(v, default=float("nan")) for v in per_step],
                       [max(v, default=float("nan")) for v in per_step], color=line.get_color(), alpha=0.15)
        k = len(runs[0]["drift_at"])
        b.plot(range(k), [statistics.fmean(r["drift_at"][j] for r in runs) for j in range(k)], marker="o",
               label=label)
    a.set(xlabel="step (rollout batch; 8 updates each)", ylabel="mean training reward (0-2)",
          title="reward, mean over seeds (range shaded)")
    b.set(xlabel="optimizer updates since sampling", ylabel="routing drift (share of top-k choices moved)",
          title="drift vs reuse, mean over seeds")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_moe_tiny_bench(steps: int = 40, seeds: tuple[int, ...] = (0, 1, 2), lr: float = LR,
                       experts: int = EXPERTS, png: Path = Path("runs/bench_moe_tiny.png")) -> list[dict]:
    from gspo_ray.bench.common import bench_cfg
    from gspo_ray.coordinator.job import init_ray, shutdown_ray

    results = []
    with tempfile.TemporaryDirectory(prefix="gspo-bench-moe-tiny-") as tmp:
        head = init_ray(bench_cfg(Path(tmp), "ray", 1))  # one Ray for every run: each job joins it
        try:
            for seed in seeds:
                for label, level, replay, extra in VARIANTS:
                    results.append(bench_moe_variant(
                        label, level, replay, steps, seed, Path(tmp), lr, model=tiny_moe_model(experts),
                        recipe=TINY_RECIPE, passes=PASSES, minibatches=MINIBATCHES,
                        overrides=("data.num_eval=64", *extra)))  # evaluated at start and end
                    print(format_moe(results[-1:]).splitlines()[-1], flush=True)
        finally:
            shutdown_ray(head)
    png.parent.mkdir(parents=True, exist_ok=True)
    plot_rewards(results, png)
    print(f"make run's tiny Qwen3-MoE widened to {experts} experts top-2 (random init), copy task, 16 prompts x 8, "
          f"lr {lr:g}, {PASSES} passes x {MINIBATCHES} mini-batches per batch, old log-probs recomputed, {steps} "
          f"steps per run\n" + format_moe(results) + "\n\nover seeds\n" + format_summary(summarise(results))
          + f"\nplot: {png}", flush=True)
    return results
