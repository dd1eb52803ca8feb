"""`gspo-ray bench` / `make bench`: per-phase time of a training step and steady-state samples/s, as a table.

Runs the tiny-MoE recipe for a few steps in each mode (sync / async x engine log-probs / recomputed) on one
local Ray instance and reports the mean over steady-state steps (the first steps, which include warm-up, are
skipped). Phases: rollout (generate + reward, waiting included), train (all optimizer steps of the batch),
sync (export + push + probe verification). Idle is the part of a step a pool is not working for it:
rollout idle = step - rollout wait (sync mode; in async mode the next batch samples during training),
trainer idle = step - train. Then GSPO vs GRPO clip fractions, whole vs partial rollouts, and the clip band with
2 passes x 4 mini-batches: GSPO fixed vs `algorithm.eps: auto` vs GRPO (eps.py).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from gspo_ray.bench.common import bench_cfg
from gspo_ray.bench.eps import bench_eps
from gspo_ray.coordinator.tracking import read_metrics

MODES = [("sync", False), ("async", False), ("sync", True), ("async", True)]
COLUMNS = ["step_s", "rollout_s", "train_s", "sync_s", "rollout_idle_s", "trainer_idle_s", "samples_per_s",
           "push_mb"]


def bench_mode(mode: str, recompute: bool, steps: int, out_dir: Path) -> dict[str, float]:
    from gspo_ray.coordinator.job import run_job

    cfg = bench_cfg(out_dir, f"bench-{mode}-{recompute}", steps, f"coordinator.mode={mode}",
                     f"coordinator.recompute_old_logprobs={recompute}", "coordinator.filter_zero_adv=false")
    summary = run_job(cfg)
    rows = read_metrics(summary.run_dir / "metrics.jsonl")[2:] or read_metrics(summary.run_dir / "metrics.jsonl")
    mean = lambda key: sum(r.get(key) or 0.0 for r in rows) / len(rows)  # noqa: E731
    step, rollout, train = mean("time/step_s"), mean("time/rollout_s"), mean("time/train_s")
    samples = cfg.coordinator.prompts_per_step * cfg.rollout.group_size
    return {"step_s": step, "rollout_s": rollout, "train_s": train, "sync_s": mean("time/sync_s"),
            "rollout_idle_s": max(step - rollout, 0.0) if mode == "sync" else max(step - mean("rollout/gen_s"), 0.0),
            "trainer_idle_s": max(step - train, 0.0), "samples_per_s": samples / step,
            "push_mb": mean("sync/push_mb")}


def bench_clipping(steps: int, out_dir: Path) -> str:
    """GSPO vs GRPO on the same tiny MoE run: clip fractions with 2 passes x 2 mini-batches per batch (clipping
    acts only once the policy has moved since sampling)."""
    from gspo_ray.coordinator.job import run_job

    rows = []
    for level in ("sequence", "token"):
        cfg = bench_cfg(out_dir, f"clip-{level}", steps, f"algorithm.importance_sampling_level={level}",
                         "coordinator.num_iterations=2", "coordinator.num_minibatches=2")
        metrics = read_metrics(run_job(cfg).run_dir / "metrics.jsonl")
        mean = lambda key: sum(r.get(key) or 0.0 for r in metrics) / len(metrics)  # noqa: E731
        rows.append((level, cfg.algorithm.clip_range(), mean("train/clip_frac_tok"), mean("train/clip_frac_seq"),
                     mean("rollout/reward_mean")))
    lines = [f"{'level':<10}{'eps (low, high)':>20}{'clip_frac_tok':>16}{'clip_frac_seq':>16}{'reward':>10}"]
    lines += [f"{lvl:<10}{str(eps):>20}{tok:>16.4f}{seq:>16.4f}{rew:>10.3f}" for lvl, eps, tok, seq, rew in rows]
    ratio = rows[0][2] / rows[1][2] if rows[1][2] > 0 else float("inf")
    lines.append(f"GSPO clips {ratio:.1f}x the token fraction of GRPO (paper: about two orders of magnitude)")
    return "\n".join(lines)


def bench_partial(steps: int, out_dir: Path) -> str:
    """Whole completions vs partial rollouts (8-token segments, at most 3) on the untrained tiny MoE with up to 24
    new tokens, so lengths vary: per step, what the engine generated, how fast, and what trained."""
    from gspo_ray.coordinator.job import run_job

    partial = ["rollout.partial.segment_tokens=8", "rollout.partial.max_segments=3",
               "rollout.partial.stale_policy=mask", "rollout.partial.max_staleness=1"]
    runs = [("whole completions", []), ("partial 8 tok x 3 seg", partial),
            ("partial, async", [*partial, "coordinator.mode=async"])]
    lines = [f"{'rollout':<24}{'step_s':>10}{'gen_s':>10}{'gen_tok':>10}{'tok/s':>10}{'groups':>8}"
             f"{'segments':>10}{'multi_ver':>10}{'masked':>8}"]
    for label, extra in runs:
        cfg = bench_cfg(out_dir, f"partial-{len(extra)}", steps, "rollout.max_new_tokens=24",
                         "coordinator.filter_zero_adv=false", *extra)
        rows = read_metrics(run_job(cfg).run_dir / "metrics.jsonl")[2:]
        mean = lambda key: sum(r.get(key) or 0.0 for r in rows) / max(len(rows), 1)  # noqa: E731
        tok_s = mean("rollout/tokens") / max(mean("rollout/gen_s"), 1e-9)
        lines.append(f"{label:<24}{mean('time/step_s'):>10.3f}{mean('rollout/gen_s'):>10.3f}"
                     f"{mean('rollout/tokens'):>10.0f}{tok_s:>10.0f}"
                     f"{mean('rollout/groups_trained'):>8.1f}{mean('rollout/segments_mean') or 1.0:>10.2f}"
                     f"{mean('rollout/multi_version_samples'):>10.1f}{mean('rollout/stale_masked_tokens'):>8.1f}")
    return "\n".join(lines)


def format_table(results: list[tuple[str, dict[str, float]]]) -> str:
    head = f"{'mode':<22}" + "".join(f"{c:>15}" for c in COLUMNS)
    lines = [head, "-" * len(head)]
    for name, r in results:
        lines.append(f"{name:<22}" + "".join(f"{r[c]:>15.3f}" for c in COLUMNS))
    return "\n".join(lines)


def run_bench(quick: bool = False) -> str:
    import ray

    steps = 4 if quick else 10
    results = []
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,  # one Ray for all runs: jobs join it
             runtime_env={"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}})
    with tempfile.TemporaryDirectory() as tmp:
        for mode, recompute in MODES:
            name = f"{mode}, {'recompute' if recompute else 'engine logp'}"
            results.append((name, bench_mode(mode, recompute, steps, Path(tmp))))
        table = format_table(results)
        print(f"tiny Qwen3-MoE, 16 prompts x 8 samples per step, mean over steps 3..{steps}\n" + table, flush=True)
        clip = bench_clipping(steps=10 if quick else 30, out_dir=Path(tmp))
        print("\nGSPO vs GRPO, 2 passes x 2 mini-batches per rollout batch\n" + clip, flush=True)
        partial = bench_partial(steps=6 if quick else 12, out_dir=Path(tmp))
        eps_steps = 10 if quick else 30
        eps_table = bench_eps(steps=eps_steps, out_dir=Path(tmp))  # GSPO fixed vs eps auto vs GRPO, 2 x 4 reuse
    ray.shutdown()
    print(f"\nwhole vs partial rollouts, up to 24 new tokens, mean over steps 3..{6 if quick else 12} (per step; "
          "multi_ver = trained samples spanning >= 2 policy versions, masked = tokens masked as stale)\n" + partial)
    print(f"\nclip band: GSPO fixed vs eps auto vs GRPO, 2 passes x 4 mini-batches, {eps_steps} steps\n" + eps_table)
    return "\n".join([table, clip, partial, eps_table])
