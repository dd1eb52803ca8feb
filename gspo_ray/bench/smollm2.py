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
from gspo_ray.bench.limits import format_limits, format_peaks, limit_rows, measure_peaks, phase_work
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
# its whole prompt), the layout before prompt groups were shared, for the before/after comparison; or with
# `-lora`: the LoRA recipes' rank-16 adapters (alpha 32) on every linear, the base frozen, adapter-only pushes
# (`-lora-merged`: the same adapters, the engines given the merged weights: trainer.lora.serve merged)
MODES = ("sync", "async", "sync-unshared")
LORA_MODES = ("sync", "sync-lora", "sync-lora-merged")
LORA_RANK, LORA_ALPHA = 16, 32  # as recipes/smollm2_*_lora.yaml; the default targets are every linear
LR, LORA_LR = 1e-6, 2e-5  # LoRA moves the model ~20x less per unit of lr (docs/lora.md): the same movement


def nonembedding_params(model_dir: Path) -> tuple[int, int]:
    """(non-embedding parameters, output-layer parameters) of a Llama-style HF config: what the FLOP count uses."""
    import json

    c = json.loads((model_dir / "config.json").read_text())
    h, inter, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads", heads) * head_dim
    per_layer = h * heads * head_dim * 2 + 2 * h * kv + 3 * h * inter + 2 * h  # q, o, k, v, gate/up/down, 2 norms
    return c["num_hidden_layers"] * per_layer + h, c["vocab_size"] * h


def mean_prompt_tokens(cfg, model_dir: Path, steps: int) -> float:
    """Mean prompt length (tokens) of the prompts the run draws: what the engine prefills once per group."""
    from gspo_ray.data.prompts import PromptSource, load_tokenizer

    prompts = PromptSource.from_config(cfg.data, load_tokenizer(model_dir), max_new_tokens=cfg.rollout.max_new_tokens,
                                       max_model_len=cfg.rollout.max_model_len).take(cfg.coordinator.prompts_per_step
                                                                                     * steps)
    return statistics.mean(len(p.prompt_ids) for p in prompts)


def train_work(steady: list[dict], body: int, head: int) -> tuple[float, float]:
    """(tokens the trainer's forwards computed, useful training FLOPs) of a step: the median over the `steady`
    metric rows. FLOPs: 6 x the `body` (non-embedding) parameters per forwarded token (forward 2, backward 4) plus
    the `head` (output layer) on the scored (generated) tokens only. `train/forward_tokens` is already the sum over
    the DP ranks and the step's mini-batches (trainer/metric_accumulator.py dp_token_metrics): never x DP again."""
    forward_tokens = statistics.median(r.get("train/forward_tokens") or 0.0 for r in steady)
    scored = statistics.median(r.get("rollout/tokens") or 0.0 for r in steady)
    return forward_tokens, 6 * body * forward_tokens + 6 * head * scored


def bench_smollm2_mode(mode: str, steps: int, out_dir: Path, model_dir: Path, recipe: Path = RECIPE) -> dict:
    from gspo_ray.coordinator.job import run_job

    coordinator_mode, _, variant = mode.partition("-")
    lora = ["trainer.lora=null"]
    if variant.startswith("lora"):
        serve = "merged" if variant == "lora-merged" else "adapter"
        lora = [f"trainer.lora={{rank: {LORA_RANK}, alpha: {LORA_ALPHA}, serve: {serve}}}"]
    cfg = load_config(recipe, [f"model.path={model_dir}", "model.packaged=null", f"coordinator.steps={steps}", "coordinator.eval_every=0",
                               "coordinator.checkpoint_every=0", "data.num_eval=0", f"coordinator.mode={coordinator_mode}",
                               f"trainer.shared_prefix={variant != 'unshared'}",
                               "coordinator.filter_zero_adv=false", f"logging.out_dir={out_dir}",
                               f"name=bench-smollm2-{mode}", "logging.progress=false", "logging.tensorboard=false",
                               "logging.plot=false", "trainer.router_churn_every=0",
                               # the speed table against TRL was taken at lr 1e-6, where completions keep their
                               # length (~23 tokens); the recipe's 1e-5 learns and shortens them
                               f"trainer.lr={LORA_LR if variant.startswith('lora') else LR}", *lora])
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
    body, head = nonembedding_params(model_dir)
    forward_tokens, flops = train_work(steady, body, head)
    work = phase_work(body, head, forward_tokens=forward_tokens, scored_tokens=mean("rollout/tokens"),
                      decode_tokens=mean("rollout/tokens"),
                      prefill_tokens=cfg.coordinator.prompts_per_step * mean_prompt_tokens(cfg, model_dir, steps),
                      decode_steps=mean("rollout/mean_len"), bytes_per_param=4 if cfg.rollout.dtype == "float32" else 2,
                      push_bytes=mean("sync/push_mb") * 2 ** 20)
    return {"mode": mode, "steps": len(steady), "step_s": step, "rollout_s": mean("time/rollout_s"),
            "push_mb": push_mb, "export_s": mean("sync/export_s"), "load_s": mean("sync/load_s"),
            "verify_s": mean("sync/verify_s"),
            "train_s": mean("time/train_s"), "sync_s": mean("time/sync_s"), "push_s": push_s,
            "push_mb_s": push_mb / push_s if push_s else 0.0, "completions_per_s": completions / step,
            "gen_tokens_per_s": mean("rollout/tokens_per_s"),
            "fwd_train": mean("train/forward_passes_train"), "fwd_old": mean("train/forward_passes_old_logprobs"),
            "fwd_probe": mean("train/forward_passes_probe"),
            "forward_tokens": forward_tokens, "row_tokens": mean("train/row_tokens"),
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "train_gflops": flops / mean("time/train_s") / 1e9 if mean("time/train_s") else 0.0,
            "work": work, "dtype": cfg.rollout.dtype,
            "peak_total_gib": mem.total / GIB, "peak_gib": {k: v / GIB for k, v in mem.per_process.items()},
            "wall_s": time.time() - start}


def format_smollm2(results: list[dict]) -> str:
    head = ("| mode | s/step | rollout s | train s | sync s | push s: export, load, probe check (MB) | completions/s | "
            "gen tok/s | trainer forwards per batch: train / old-logp / push probe | tokens forwarded (one row per sample) | "
            "train GFLOP/s | peak PSS trainer GiB | peak PSS job GiB |")
    lines = table_head(head)
    for r in results:
        lines.append(f"| {r['mode']} | {r['step_s']:.1f} | {r['rollout_s']:.1f} | {r['train_s']:.1f} | "
                     f"{r['sync_s']:.2f} | {r['export_s']:.3f}, {r['load_s']:.3f}, {r['verify_s']:.3f} "
                     f"({r['push_mb']:.1f}) | {r['completions_per_s']:.2f} | "
                     f"{r['gen_tokens_per_s']:.0f} | {r['fwd_train']:.0f} / {r['fwd_old']:.0f} / {r['fwd_probe']:.0f} | "
                     f"{r['forward_tokens']:.0f} ({r['row_tokens']:.0f}) | {r['train_gflops']:.0f} | "
                     f"{r['peak_gib'].get('trainer', 0.0):.2f} | {r['peak_total_gib']:.1f} |")
    for r in results:
        procs = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["peak_gib"].items(), key=lambda kv: -kv[1])[:6])
        lines.append(f"peak PSS by process ({r['mode']}, GiB): {procs}")
    return "\n".join(lines)


def run_smollm2_bench(steps: int = 6, modes: tuple[str, ...] = MODES,
                      model_dir: Path = Path("runs/models/smollm2-135m-instruct"), recipe: Path = RECIPE) -> list[dict]:
    """model_dir: where the packaged model is imported once (the recipe's default place) and reused; `recipe`:
    whose task, reward and batch shape (LORA_MODES on the sum recipe: LoRA against full fine-tuning)."""
    from gspo_ray.models.gguf import ensure_imported

    ensure_imported(model_dir)
    before = measure_peaks()
    with tempfile.TemporaryDirectory(prefix="gspo-bench-smollm2-") as tmp:
        results = [bench_smollm2_mode(mode, steps, Path(tmp), model_dir, recipe) for mode in modes]
    after = measure_peaks()
    print(f"SmolLM2-135M-Instruct, {Path(recipe).name}, 8 prompts x 8 completions, <= {results[0]['max_new_tokens']} "
          f"new tokens, fp32, 1 optimizer step per batch, lr {LR} (LoRA {LORA_LR}), median over steps 2..{steps}\n"
          + format_smollm2(results), flush=True)
    print(format_peaks(before, after), flush=True)
    for r in results:
        dtype = "bf16" if r["dtype"] == "bfloat16" else "fp32"
        peak = max(before[f"{dtype}_gflops"], after[f"{dtype}_gflops"])
        copy = max(before["copy_gbs"], after["copy_gbs"])
        r["limits"] = limit_rows(r["work"], {"rollout": r["rollout_s"], "train": r["train_s"], "sync": r["sync_s"]},
                                 peak, copy)
        print(format_limits(r["limits"], f"{r['mode']}, at {peak:.0f} GFLOP/s {dtype}, {copy:.1f} GB/s copy"),
              flush=True)
    return results
