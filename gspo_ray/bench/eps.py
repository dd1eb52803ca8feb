"""Bench table: GSPO with the fixed 3e-4/4e-4 band vs `algorithm.eps: auto` vs GRPO, on one reuse schedule.

    .venv/bin/python -m gspo_ray.bench.eps [--steps 30]      # this table only (also in `make bench`)

The tiny-MoE copy recipe with 2 passes x 4 mini-batches per rollout batch (8 optimizer steps per batch, so 7 of
8 train a policy that moved since sampling), the same seeds for all three. Columns: the band at the end; the
sequence clip fraction on reuse mini-batches (mean over steps; the first mini-batch of a batch is on-policy and
clips nothing, so reuse = (8 * all - first) / 7), the token clip fraction over all mini-batches, training reward
over the last 5 steps, held-out greedy reward at the end (64 prompts, max 2.0), wall time of the run.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

RUNS = [("GSPO fixed 3e-4/4e-4", ["algorithm.importance_sampling_level=sequence"]),
        ("GSPO eps auto", ["algorithm.importance_sampling_level=sequence", "algorithm.eps=auto"]),
        ("GRPO 0.2/0.27", ["algorithm.importance_sampling_level=token"])]
SCHEDULE = ["coordinator.num_iterations=2", "coordinator.num_minibatches=4"]


def _run(label: str, extra: list[str], steps: int, out_dir: Path) -> dict[str, float | str]:
    from gspo_ray.bench.common import bench_cfg
    from gspo_ray.coordinator.job import run_job
    from gspo_ray.coordinator.tracking import read_metrics

    cfg = bench_cfg(out_dir, f"eps-{len(extra)}-{extra[0].split('=')[1]}", steps, *SCHEDULE, *extra,
                     "data.num_eval=64", "logging.export_hf=none")
    t0 = time.perf_counter()
    summary = run_job(cfg)
    wall = time.perf_counter() - t0
    rows = [r for r in read_metrics(summary.run_dir / "metrics.jsonl") if "train/clip_frac_seq" in r]
    n = cfg.coordinator.num_iterations * cfg.coordinator.num_minibatches
    last = rows[-1]
    return {"run": label, "eps": f"{last['train/eps_low']:.2e}/{last['train/eps_high']:.2e}",
            "clip_seq_reuse": _reuse_clip(rows, n), "clip_seq_reuse_last10": _reuse_clip(rows[-10:], n),
            "clip_tok": _mean(rows, "train/clip_frac_tok"), "reward_last5": _mean(rows[-5:], "rollout/reward_mean"),
            "eval_reward": summary.eval_history[-1][1] if summary.eval_history else float("nan"), "wall_s": wall,
            "lr": cfg.trainer.lr}


def _mean(rows: list[dict], key: str) -> float:
    return sum(r.get(key) or 0.0 for r in rows) / max(len(rows), 1)


def _reuse_clip(rows: list[dict], n: int) -> float:
    """Sequence clip fraction of the n - 1 reuse mini-batches: a step logs the mean over its n mini-batches and
    the first one separately, so reuse = (n * mean - first) / (n - 1)."""
    return (n * _mean(rows, "train/clip_frac_seq") - _mean(rows, "train/clip_frac_seq_first_mb")) / (n - 1)


def bench_eps(steps: int, out_dir: Path, echo: bool = False) -> str:
    """The three runs, as a table (echo: print each row as its run ends)."""
    head = (f"{'run':<22}{'eps_low/eps_high':>20}{'clip_seq_reuse':>16}{'..last10':>10}{'clip_tok':>10}"
            f"{'reward':>9}{'eval':>7}{'wall_s':>8}")
    lines = [head, "-" * len(head)]
    if echo:
        print("\n".join(lines), flush=True)
    for label, extra in RUNS:
        r = _run(label, extra, steps, out_dir)
        lines.append(f"{r['run']:<22}{r['eps']:>20}{r['clip_seq_reuse']:>16.3f}{r['clip_seq_reuse_last10']:>10.3f}"
                     f"{r['clip_tok']:>10.4f}{r['reward_last5']:>9.3f}{r['eval_reward']:>7.3f}{r['wall_s']:>8.0f}")
        if echo:
            print(lines[-1], flush=True)
    lines.append(f"tiny Qwen3-MoE copy task, lr {r['lr']:g}, 16 prompts x 8, 2 passes x 4 mini-batches, {steps} "
                 "steps; reward = rollout mean over the last 5 steps, eval = held-out greedy at the end (both max "
                 "2.0); eps auto targets a reuse sequence clip fraction of 0.15")
    return "\n".join(lines)


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            print("\n" + bench_eps(args.steps, Path(tmp), echo=True), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
