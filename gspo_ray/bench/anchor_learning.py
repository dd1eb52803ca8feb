"""`gspo-ray bench --suite anchor-learn [--seeds 0,1,2] [--steps N]`: does GSPO anchored on the engine's bf16
log-probs learn as well as with the trainer's recomputed anchor (what verl and slime do), and what does the
old-policy forward it saves cost?

The tiny-MoE recipe as `make run` ships it (4-digit copy, async, 1 pass x 1 mini-batch, the recipe's early stop at
held-out reward 1.95, capped at `--steps`, default 450), once per seed and variant, the variants of one seed run
back to back (one sitting, the same machine load):

- **bf16, engine anchor**: both pools bf16 with fp32 LM heads (`rollout.head_dtype` / `trainer.head_dtype`), the
  engine's log-probs as the old policy, `algorithm.eps: auto` (the recipe's band), the gap checked by the job at
  step 1 (`train/anchor_gap_*`);
- **bf16, recomputed anchor**: the same pools, `coordinator.recompute_old_logprobs: true` (one more trainer
  forward per batch), the paper's fixed band 3e-4 / 4e-4 (in 1 x 1 async the recomputed ratio is 1 on the batch's
  only pass: auto has no reuse mini-batch to measure), and `algorithm.mismatch_correction` geometric (the
  engine-trainer gap and the batch's one-update staleness weighed per completion, what the config requires);
- **fp32, engine anchor**: the recipe unchanged, the reference.

Per run: the held-out greedy exact at each evaluation (every 25 steps), the step at which it first reaches 0.95,
the mean train-phase seconds per step (`time/train_s`) and of it the old-policy forward (`time/old_logprobs_s`),
trainer forwards per step by purpose, the anchor gap at step 1 where the job measured it. Results are appended to
`runs/bench/anchor_learn.jsonl` (a long sweep can be split over sittings) and the tables and a PNG are built from
every run there of the same step cap.

bf16 runs as fast as the host's bf16 kernels allow: on a CPU without a native bf16 matmul (AMD EPYC) the bf16
variants' seconds say nothing about a GPU or an AMX host; the learning comparison holds anywhere.
"""
from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from gspo_ray.bench.common import TINY_RECIPE, markdown_table

BF16 = ("rollout.dtype=bfloat16", "trainer.dtype=bfloat16", "rollout.head_dtype=float32", "trainer.head_dtype=float32")
VARIANTS = {  # label -> overrides of the tiny recipe
    "bf16 engine anchor": BF16,
    "bf16 recomputed anchor": (*BF16, "coordinator.recompute_old_logprobs=true", "algorithm.eps=fixed",
                               "algorithm.mismatch_correction.level=geometric"),
    "fp32 engine anchor": (),
}
RESULTS = Path("runs/bench/anchor_learn.jsonl")


def run_summary(run: dict) -> dict:
    """What a finished learn_run's metrics say beyond its curve: per-step train seconds, the old-policy forward's
    share, forwards per step by purpose and the step-1 anchor gap."""
    from gspo_ray.coordinator.tracking import read_metrics

    rows = [r for r in read_metrics(Path(run["run_dir"]) / "metrics.jsonl") if r["step"] > 0]
    steps = [r for r in rows if "time/train_s" in r]

    def mean(key: str) -> float | None:
        values = [r[key] for r in steps if key in r]
        return statistics.mean(values) if values else None

    passes = {k.removeprefix("train/forward_passes_"): sum(r.get(k, 0.0) for r in steps) / max(len(steps), 1)
              for k in sorted({k for r in steps for k in r if k.startswith("train/forward_passes_")})}
    gap = next((r for r in rows if "train/anchor_gap_seq_std" in r), {})
    return {"train_s_per_step": mean("time/train_s"), "old_logprobs_s_per_step": mean("time/old_logprobs_s") or 0.0,
            "forwards_per_step": passes, "clip_frac_seq": mean("train/clip_frac_seq"),
            "anchor_gap": {k.removeprefix("train/anchor_gap_"): v for k, v in gap.items()
                           if k.startswith("train/anchor_gap_")}}


def run_anchor_learning_bench(seeds: tuple[int, ...] = (0, 1, 2), steps: int = 450,
                              variants: tuple[str, ...] = tuple(VARIANTS), results: Path = RESULTS) -> str:
    from gspo_ray.bench.learning import learn_run

    results.parent.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        for label in variants:
            with tempfile.TemporaryDirectory(prefix="bench-anchor-") as tmp:
                run = learn_run(TINY_RECIPE, seed, Path(tmp), (*VARIANTS[label], f"coordinator.steps={steps}"))
                run.update(run_summary(run), variant=label, step_cap=steps)
            with results.open("a") as f:
                f.write(json.dumps(run) + "\n")
            print(f"{label} seed {seed}: solved at step {run['solved_at']}, {run['train_s_per_step']:.3f} s "
                  "train per step", flush=True)
    return anchor_learning_report(steps, results)


def anchor_learning_report(steps: int = 450, results: Path = RESULTS) -> str:
    """Tables and a PNG from every run in `results` with this step cap."""
    runs = [r for r in map(json.loads, results.read_text().splitlines()) if r.get("step_cap") == steps]
    if not runs:
        return f"no runs with step cap {steps} in {results}"
    per_run = [{"variant": r["variant"], "seed": r["seed"], "solved at step": r["solved_at"],
                "final held-out exact": r["curve"][-1][2] if r["curve"] else None,
                "final held-out reward": r["curve"][-1][3] if r["curve"] else None,
                "train s / step": r["train_s_per_step"], "of it old-policy forward s": r["old_logprobs_s_per_step"],
                "forwards / step": ", ".join(f"{k} {v:.2f}" for k, v in r["forwards_per_step"].items()),
                "seq clip frac": r["clip_frac_seq"],
                "gap seq std @1": r["anchor_gap"].get("seq_std"),
                "gap token mean @1": r["anchor_gap"].get("token_mean"),
                "job wall s": r["wall_s"]} for r in runs]
    over = []
    for label in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == label]
        solved = [r["solved_at"] for r in mine if r["solved_at"] is not None]
        over.append({"variant": label, "seeds": len(mine), "solved": f"{len(solved)}/{len(mine)}",
                     "mean step solved (solved seeds)": float(statistics.mean(solved)) if solved else None,
                     "train s / step (mean)": statistics.mean(r["train_s_per_step"] for r in mine),
                     "old-policy forward s / step": statistics.mean(r["old_logprobs_s_per_step"] for r in mine)})
    png = plot_variants(runs, results.with_suffix(".png"), steps)
    return (f"anchor learning, tiny MoE copy task, step cap {steps}, per run\n{markdown_table(per_run)}\n\n"
            f"over seeds\n{markdown_table(over)}\n\ncurves: {png}")


def plot_variants(runs: list[dict], path: Path, steps: int) -> Path:
    """Held-out exact against steps, one colour per variant, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    colours = dict(zip(dict.fromkeys(r["variant"] for r in runs), ("C0", "C1", "C2", "C3")))
    for label, colour in colours.items():
        for i, r in enumerate(x for x in runs if x["variant"] == label):
            ax.plot([c[0] for c in r["curve"]], [c[2] for c in r["curve"]], color=colour, marker="o", markersize=3,
                    label=label if i == 0 else None)
    ax.set(xlabel="step", ylabel="held-out greedy exact", ylim=(-0.03, 1.03), xlim=(0, steps),
           title="engine bf16 anchor vs recomputed anchor (one line per seed)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
