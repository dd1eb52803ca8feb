"""`gspo-ray bench --suite smollm2`: the real-model table (SmolLM2-135M-Instruct, `recipes/smollm2_repeat.yaml`).

    gspo-ray bench --suite smollm2 [--steps 6]

Runs the recipe's settings (8 prompts x 8 completions, <= the recipe's `rollout.max_new_tokens` new tokens (16), fp32,
one optimizer step per batch, no zero-advantage filtering) for a few steps in sync and async mode and prints the
median over the steady-state steps (the first is skipped: it includes warm-up; TRL's peer takes the same median): s/step with its rollout / train / sync split, completions/s, generated tokens/s,
push time and MB/s, the trainer's forward passes per rollout batch, and the peak memory (PSS) of every process of
the job and of the whole job, sampled from the driver's process tree (Ray's own daemons included).
"""
from __future__ import annotations

import statistics

import os
import tempfile
import threading
import time
from pathlib import Path

from gspo_ray.bench.common import SMOLLM2_RECIPE as RECIPE
from gspo_ray.bench.common import table_head
from gspo_ray.config import load_config
from gspo_ray.coordinator.tracking import read_metrics

GIB = 1024 ** 3


class PeakPss:
    """Samples the PSS of this process and all its descendants every `interval_s`; keeps the peak per process
    (by command name) and the peak of the sum. PSS splits shared pages between the processes sharing them, so the
    per-process numbers add up to the job's footprint (RSS would count shared libraries once per process).
    Reading PSS walks a process's page tables in the kernel: measured here, 0.11 s of system time for a process
    with 4.8 GB resident, so a sample of this job (trainer ~5 GB, engine ~3.5 GB, driver, Ray) costs ~0.25 s of
    CPU. Every 0.5 s that took ~a quarter of the two cores from the job it measured; every 10 s it is ~1%, and a
    peak shorter than the interval can be missed (steps here last 30-80 s)."""

    def __init__(self, interval_s: float = 10.0):
        self.interval_s = interval_s
        self.per_process: dict[str, float] = {}
        self.total = 0.0
        self.root_pid = os.getpid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _label(self, proc) -> str:
        try:
            title = " ".join(proc.cmdline())[:80] or proc.name()
        except Exception:
            title = proc.name()
        if "TrainerWorker" in title:
            return "trainer"
        if "RolloutWorker" in title:
            return "rollout (vLLM engine)"
        return "driver" if proc.pid == self.root_pid else (proc.name() or "other")

    def _sample(self) -> None:
        import psutil

        root = psutil.Process(self.root_pid)
        total, seen = 0.0, {}
        for proc in [root, *root.children(recursive=True)]:
            try:
                pss = proc.memory_full_info().pss
            except Exception:  # exited between listing and reading
                continue
            label = self._label(proc)
            seen[label] = seen.get(label, 0.0) + pss
            total += pss
        for label, pss in seen.items():
            self.per_process[label] = max(self.per_process.get(label, 0.0), pss)
        self.total = max(self.total, total)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakPss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# a mode is the coordinator's mode, optionally with `-unshared`: the trainer's rows one per sample (each carrying
# its whole prompt), the layout before prompt groups were shared, for the before/after comparison
MODES = ("sync", "async", "sync-unshared")


def nonembedding_params(model_dir: Path) -> tuple[int, int]:
    """(non-embedding parameters, output-layer parameters) of a Llama-style HF config: what the FLOP count uses."""
    import json

    c = json.loads((model_dir / "config.json").read_text())
    h, inter, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads", heads) * head_dim
    per_layer = h * heads * head_dim * 2 + 2 * h * kv + 3 * h * inter + 2 * h  # q, o, k, v, gate/up/down, 2 norms
    return c["num_hidden_layers"] * per_layer + h, c["vocab_size"] * h


def bench_smollm2_mode(mode: str, steps: int, out_dir: Path, model_dir: Path) -> dict:
    from gspo_ray.coordinator.job import run_job

    coordinator_mode, _, variant = mode.partition("-")
    cfg = load_config(RECIPE, [f"model.path={model_dir}", "model.packaged=null", f"coordinator.steps={steps}", "coordinator.eval_every=0",
                               "coordinator.checkpoint_every=0", "data.num_eval=0", f"coordinator.mode={coordinator_mode}",
                               f"trainer.shared_prefix={variant != 'unshared'}",
                               "coordinator.filter_zero_adv=false", f"logging.out_dir={out_dir}",
                               f"name=bench-smollm2-{mode}", "logging.progress=false", "logging.tensorboard=false",
                               "logging.plot=false", "trainer.router_churn_every=0",
                               # the speed table against TRL was taken at lr 1e-6, where completions keep their
                               # length (~23 tokens); the recipe's 1e-5 learns and shortens them
                               "trainer.lr=1e-6"])
    start = time.time()
    with PeakPss() as mem:
        summary = run_job(cfg)
    rows = read_metrics(summary.run_dir / "metrics.jsonl")
    steady = rows[1:] or rows
    # the median of the steady steps, as the TRL peer reports (peer_trl.py): the two sides compare like for like
    mean = lambda key: statistics.median(r.get(key) or 0.0 for r in steady)  # noqa: E731
    step = mean("time/step_s")
    completions = cfg.coordinator.prompts_per_step * cfg.rollout.group_size
    push_s, push_mb = mean("sync/push_s"), mean("sync/push_mb")
    # useful training FLOPs: 6 x non-embedding parameters per forwarded token (forward 2, backward 4) plus the
    # output layer on the scored (generated) tokens only
    body, head = nonembedding_params(model_dir)
    # train/forward_tokens is rank 0's own count; train/row_tokens the whole mini-batch's: x DP for the job's
    # (exact at the recipe's one rank; at DP > 1 it assumes the ranks balanced, train/dp_imbalance says how far)
    dp = cfg.trainer.num_workers // cfg.trainer.tp
    forward_tokens = dp * mean("train/forward_tokens")
    flops = 6 * body * forward_tokens + 6 * head * mean("rollout/tokens")
    return {"mode": mode, "steps": len(steady), "step_s": step, "rollout_s": mean("time/rollout_s"),
            "train_s": mean("time/train_s"), "sync_s": mean("time/sync_s"), "push_s": push_s,
            "push_mb_s": push_mb / push_s if push_s else 0.0, "completions_per_s": completions / step,
            "gen_tokens_per_s": mean("rollout/tokens_per_s"),
            "fwd_train": mean("train/forward_passes_train"), "fwd_old": mean("train/forward_passes_old_logprobs"),
            "fwd_probe": mean("train/forward_passes_probe"),
            "forward_tokens": forward_tokens, "row_tokens": mean("train/row_tokens"),
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "train_gflops": flops / mean("time/train_s") / 1e9 if mean("time/train_s") else 0.0,
            "peak_total_gib": mem.total / GIB, "peak_gib": {k: v / GIB for k, v in mem.per_process.items()},
            "wall_s": time.time() - start}


def format_smollm2(results: list[dict]) -> str:
    head = ("| mode | s/step | rollout s | train s | sync s | push s (MB/s) | completions/s | gen tok/s | "
            "trainer forwards per batch: train / old-logp / push probe | tokens forwarded (one row per sample) | "
            "train GFLOP/s | peak PSS job GiB |")
    lines = table_head(head)
    for r in results:
        lines.append(f"| {r['mode']} | {r['step_s']:.1f} | {r['rollout_s']:.1f} | {r['train_s']:.1f} | "
                     f"{r['sync_s']:.2f} | {r['push_s']:.2f} ({r['push_mb_s']:.0f}) | {r['completions_per_s']:.2f} | "
                     f"{r['gen_tokens_per_s']:.0f} | {r['fwd_train']:.0f} / {r['fwd_old']:.0f} / {r['fwd_probe']:.0f} | "
                     f"{r['forward_tokens']:.0f} ({r['row_tokens']:.0f}) | {r['train_gflops']:.0f} | "
                     f"{r['peak_total_gib']:.1f} |")
    for r in results:
        procs = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["peak_gib"].items(), key=lambda kv: -kv[1])[:6])
        lines.append(f"peak PSS by process ({r['mode']}, GiB): {procs}")
    return "\n".join(lines)


def run_smollm2_bench(steps: int = 6, modes: tuple[str, ...] = MODES,
                      model_dir: Path = Path("runs/models/smollm2-135m-instruct")) -> list[dict]:
    """model_dir: where the packaged model is imported once (the recipe's default place) and reused."""
    from gspo_ray.models.gguf import ensure_imported

    ensure_imported(model_dir)
    with tempfile.TemporaryDirectory(prefix="gspo-bench-smollm2-") as tmp:
        results = [bench_smollm2_mode(mode, steps, Path(tmp), model_dir) for mode in modes]
    print(f"SmolLM2-135M-Instruct, 8 prompts x 8 completions, <= {results[0]['max_new_tokens']} new tokens, fp32, "
          f"1 optimizer step per batch, median over steps 2..{steps}\n" + format_smollm2(results), flush=True)
    return results
