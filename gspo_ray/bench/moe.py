"""`gspo-ray bench --suite moe`: GSPO's MoE claim in miniature, on SmolLM2-135M-Instruct upcycled to a Mixtral MoE.

    gspo-ray bench --suite moe [--steps 6] [--seeds 0]

Seed 000's claim: after one gradient update ~10% of the experts a rollout activated change; token-level ratios
then swing, GRPO needs Routing Replay to converge, and GSPO's sequence ratio does not. Here, on the upcycled model
(4 experts, top-2, `models/upcycle.py`), the same task and seed run four ways: GRPO without replay, GRPO with R2
(the trainer replays the routing of its first forward over the batch), GSPO without replay and GSPO-token.
Each rollout batch is reused, 2 passes x 4 mini-batches = 8 optimizer steps, with old log-probs recomputed by
the trainer (so R2 and the drift metric record the sampling policy's routing exactly). Per step it reports the
routing drift (`moe/drift_churn`: top-k choices moved between the sampling policy and the one being updated,
per layer and after k updates), the spread of per-token log-ratios, token- and sequence-level clip fractions,
reward, and skipped (non-finite) steps; a table and a PNG.
"""
from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

from gspo_ray.bench.common import SMOLLM2_RECIPE as RECIPE
from gspo_ray.bench.common import optional_number, table_head
from gspo_ray.coordinator.tracking import read_metrics

DENSE_DIR = Path("runs/models/smollm2-135m-instruct")
MOE_DIR = Path("runs/models/smollm2-moe-4x2")
VARIANTS = [  # (label, importance_sampling_level, routing_replay)
    ("GRPO", "token", "none"),
    ("GRPO + R2", "token", "R2"),
    ("GSPO", "sequence", "none"),
    ("GSPO-token", "sequence_token", "none"),
]
PASSES, MINIBATCHES = 2, 4
UPDATES = PASSES * MINIBATCHES
SMOLLM2_BATCH = ("coordinator.prompts_per_step=8", "rollout.group_size=4", "rollout.max_new_tokens=16")


def smollm2_model(model_dir: Path) -> tuple[str, ...]:
    """The overrides that train the upcycled SmolLM2 in `model_dir`."""
    return f"model.path={model_dir}", "model.packaged=null"


def ensure_moe_model(out: Path = MOE_DIR, experts: int = 4, top_k: int = 2, noise: float = 0.01) -> Path:
    """The upcycled model, built once from the packaged SmolLM2 (imported offline) unless already there."""
    from gspo_ray.models.gguf import ensure_imported
    from gspo_ray.models.upcycle import upcycle

    if not ((out / "upcycle.json").is_file() and (out / "config.json").is_file()):
        upcycle(ensure_imported(DENSE_DIR), out, experts, top_k, noise=noise, seed=0)
    return out


def bench_moe_variant(label: str, level: str, replay: str, steps: int, seed: int, out_dir: Path, lr: float, *,
                      model: tuple[str, ...], recipe: Path = RECIPE, passes: int = PASSES,
                      minibatches: int = MINIBATCHES, overrides: tuple[str, ...] = ()) -> dict:
    """One run: `model` are the overrides that pick the model (a path, or a tiny model's shape); `overrides`
    anything else (the SmolLM2 setting's batch shape, an eps mode)."""
    from gspo_ray.bench.common import bench_cfg
    from gspo_ray.coordinator.job import run_job

    cfg = bench_cfg(
        out_dir, f"bench-moe-{label.replace(' ', '').replace('+', '-')}-s{seed}", steps, *model, f"seed={seed}",
        f"coordinator.num_iterations={passes}", f"coordinator.num_minibatches={minibatches}",
        "coordinator.recompute_old_logprobs=true", "coordinator.filter_zero_adv=false",
        f"algorithm.importance_sampling_level={level}", f"trainer.routing_replay={replay}", f"trainer.lr={lr}",
        "trainer.router_churn_every=0",
        f"trainer.routing_noise={str(replay == 'none').lower()}",  # what replay would remove, where it is off
        *overrides, recipe=recipe)
    start = time.time()
    summary = run_job(cfg)
    rows = read_metrics(summary.run_dir / "metrics.jsonl")
    rows = [r for r in rows if r.get("step", 0) > 0]  # step 0's row is the evaluation before training
    mean = lambda key: sum(r.get(key) or 0.0 for r in rows) / max(len(rows), 1)  # noqa: E731
    layers = sorted({int(k.rsplit("_l", 1)[1]) for r in rows for k in r if k.startswith("moe/drift_churn_l")})
    spread = [math.sqrt(max(r["train/logr_sq_mean"] - r["train/logr_mean"] ** 2, 0.0)) for r in rows
              if "train/logr_sq_mean" in r]
    drift_at = [mean(f"moe/drift_churn_at{k}") for k in range(passes * minibatches)]
    return {"label": label, "level": level, "replay": replay, "seed": seed, "steps": len(rows),
            # after 1..N updates; the mini-batch before any update (drift 0 by construction) is left out
            "drift": sum(drift_at[1:]) / max(len(drift_at) - 1, 1),
            "drift_at": drift_at,
            "drift_layer": [mean(f"moe/drift_churn_l{i}") for i in layers], "layers": layers,
            "logr_std": sum(spread) / max(len(spread), 1),
            "clip_tok": mean("train/clip_frac_tok"), "clip_seq": mean("train/clip_frac_seq"),
            "reward": [r.get("rollout/reward_mean") for r in rows],
            # optimizer steps not taken (non-finite or empty), from the version: train/skipped_steps is a running
            # count averaged over a step's mini-batches, which hides a skip late in the run
            "skipped": len(rows) * passes * minibatches - rows[-1]["train/version"] if rows else 0,
            # routing-induced log-ratio (trainer.routing_noise; None under R2, whose forwards hold routing)
            "noise_d": mean("moe/routing_logratio_abs_mean") if replay == "none" else None,
            "noise_tok_removed": mean("moe/grpo_token_clips_removed") if replay == "none" else None,
            "noise_seq_removed": mean("moe/gspo_seq_clips_removed") if replay == "none" else None,
            "grad_norm": [r["train/grad_norm"] for r in rows if "train/grad_norm" in r],  # a skipped step has none
            "eval": list(summary.eval_history),
            "wall_s": time.time() - start}


def format_moe(results: list[dict]) -> str:
    head = ("| run | seed | steps | drift after 1 update | after 4 | after the last | drift, all updates (1..N) | max layer | "
            "per-token log-ratio std | clip frac token | clip frac seq | reward first -> last step | skipped | "
            "routing-induced mean abs log-ratio | GRPO clips routing alone caused | GSPO clips routing alone caused |")
    lines = table_head(head)
    for r in results:
        reward = [x for x in r["reward"] if x is not None]
        rw = f"{reward[0]:.3f} -> {reward[-1]:.3f}" if reward else "-"
        at = r["drift_at"]
        lines.append(f"| {r['label']} | {r['seed']} | {r['steps']} | {at[1]:.4f} | {at[4]:.4f} | {at[-1]:.4f} | "
                     f"{r['drift']:.4f} | {max(r['drift_layer'], default=0.0):.4f} | {r['logr_std']:.4f} | "
                     f"{r['clip_tok']:.3f} | {r['clip_seq']:.3f} | {rw} | {r['skipped']:.0f} | "
                     f"{optional_number(r.get('noise_d'), 4)} | {optional_number(r.get('noise_tok_removed'), 3)} | "
                     f"{optional_number(r.get('noise_seq_removed'), 3)} |")
    return "\n".join(lines)


def plot_moe(results: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    for r in results:
        tag = f"{r['label']} (seed {r['seed']})"
        a.plot(range(len(r["drift_at"])), r["drift_at"], marker="o", label=tag)
        b.plot(r["layers"], r["drift_layer"], label=tag)
        c.plot(range(1, len(r["reward"]) + 1), [x if x is not None else float("nan") for x in r["reward"]],
               marker=".", label=tag)
    a.set(xlabel="optimizer updates since sampling", ylabel="routing drift (share of top-k choices moved)",
          title="drift vs reuse")
    b.set(xlabel="MoE layer", ylabel="routing drift, mean over updates", title="drift per layer")
    c.set(xlabel="step (rollout batch)", ylabel="mean training reward", title="reward")
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_moe_bench(steps: int = 6, seeds: tuple[int, ...] = (0,), lr: float = 1e-5,
                  png: Path = Path("runs/bench_moe.png")) -> list[dict]:
    model_dir = ensure_moe_model()
    results = []
    with tempfile.TemporaryDirectory(prefix="gspo-bench-moe-") as tmp:
        for seed in seeds:
            for label, level, replay in VARIANTS:
                results.append(bench_moe_variant(label, level, replay, steps, seed, Path(tmp), lr,
                                                 model=smollm2_model(model_dir), overrides=SMOLLM2_BATCH))
                print(format_moe(results[-1:]).splitlines()[-1], flush=True)
    png.parent.mkdir(parents=True, exist_ok=True)
    plot_moe(results, png)
    print(f"SmolLM2-135M-Instruct upcycled to 4 experts top-2 ({model_dir}), repeat task, 8 prompts x 4, <= 16 new "
          f"tokens, lr {lr:g}, {PASSES} passes x {MINIBATCHES} mini-batches per batch, old log-probs recomputed, "
          f"{steps} steps per run\n" + format_moe(results) + f"\nplot: {png}", flush=True)
    return results
