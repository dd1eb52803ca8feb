"""`gspo-ray bench --suite memory`: the trainer's memory model (trainer/memory.py) against measured memory.

Each point runs in a fresh process (`python -m gspo_ray.bench.memory --point ...`): one in-process trainer rank (no
Ray), fp32, on SmolLM2-135M-Instruct (or make run's tiny MoE, the sanity row), a warm-up train step on a short batch
(Adam's moments are made at the first step), the heap trimmed (trainer/heap.py), then VmHWM reset and one train
step on one prompt group (a 100-token prompt, 8 completions of N random tokens), forwarded as one group row (one micro-batch). Measured: the
step's peak RSS minus the RSS before it; predicted: the model's activations and logits for that micro-batch
(`activation_bytes` + `logits_bytes` + `backward_bytes`, its tokens the group row's, its scored share the
completions'). Weights,
gradients and optimizer state are resident before the step and are in neither number.

Each point runs with glibc's mmap threshold fixed at 128 KiB (MALLOC_MMAP_THRESHOLD_, MMAP_THRESHOLD below): by
default glibc raises the threshold to the size of each large block freed (up to 32 MiB), after which blocks of
that size come from its heap and, freed, stay resident; a step that frees activations during its forward
(recompute) then shows freed memory as RSS (measured: docs/scale.md, "The memory model"). With the threshold
fixed every tensor block is its own mapping and RSS follows the live tensors, which is what the model predicts.
`--default-malloc` measures with glibc's defaults instead.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gspo_ray.bench.common import markdown_table

SMOLLM2 = Path("runs/models/smollm2-135m-instruct")
# (model, completion tokens, recompute): activations >= ~1 GiB on SmolLM2 in each, micro-batch tokens and recompute
# varied; the tiny MoE as a sanity row
POINTS = (("smollm2", 250, "none"), ("smollm2", 500, "none"), ("smollm2", 500, "selective"),
          ("smollm2", 1000, "full"), ("tiny-moe", 4000, "none"))
OUT = Path("runs/bench/memory.json")
MMAP_THRESHOLD = 131072  # glibc's default threshold, fixed (see the module docstring)
PROMPT_TOKENS = 100


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def model_dir(model: str) -> Path:
    if model == "smollm2":
        from gspo_ray.models.gguf import ensure_imported

        ensure_imported(SMOLLM2)
        return SMOLLM2
    from gspo_ray.models.tiny import ensure_tiny_model

    return ensure_tiny_model("qwen3_moe", Path("runs/models/tiny-qwen3-moe-memory"), seed=0)


def group_batch(vocab: int, completion_tokens: int, prompt_tokens: int = PROMPT_TOKENS, group: int = 8, seed: int = 0):
    """One prompt group: a prompt of random tokens and `group` completions of exactly `completion_tokens` random
    tokens (advantages +-1)."""
    import random

    from gspo_ray.data.records import Sample, collate

    rng = random.Random(seed)
    prompt = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
    samples, advs = [], []
    for j in range(group):
        n = completion_tokens
        samples.append(Sample(prompt_uid="p0", sample_index=j, prompt_ids=prompt,
                              completion_ids=[rng.randrange(3, vocab) for _ in range(n)], logprobs=[0.0] * n,
                              loss_mask=[1] * n, versions=[0] * n, finish_reason="stop"))
        advs.append([1.0 if j % 2 == 0 else -1.0] * n)
    return collate(samples, advs)


def measure_point(model: str, completion_tokens: int, recompute: str) -> dict:
    """One point, in this (fresh) process: see the module docstring."""
    import torch

    from gspo_ray.bench.common import SMOLLM2_RECIPE
    from gspo_ray.bench.train_profile import reset_peak_rss
    from gspo_ray.config import load_config
    from gspo_ray.trainer.heap import release_free_heap
    from gspo_ray.trainer.memory import GIB, Layout, MemoryShape
    from gspo_ray.trainer.model_spec import read_hf_config
    from gspo_ray.trainer.parallel import free_port
    from gspo_ray.trainer.worker import TrainerWorker

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    path = model_dir(model)
    cfg = load_config(SMOLLM2_RECIPE, ["model.packaged=null", f"model.path={path}"])
    vocab = int(read_hf_config(path)["vocab_size"])
    batch, warm = group_batch(vocab, completion_tokens), group_batch(vocab, 8)
    width = int(batch.lengths.max())
    tcfg = cfg.trainer.model_copy(update={"shared_prefix": True, "router_churn_every": 0, "lr": 1e-7,
                                          "micro_batch_tokens": 8 * width, "micro_batch_size": 8,
                                          "recompute": recompute, "dtype": "float32"})
    worker = TrainerWorker(0, 1, "127.0.0.1", free_port(), str(path), tcfg, cfg.algorithm)
    try:
        worker.train_step(warm)  # Adam's moments are made here
        release_free_heap()
        base = _rss_kib("VmRSS")
        reset_peak_rss()
        t0 = time.perf_counter()
        metrics = worker.train_step(batch)
        step_s = time.perf_counter() - t0
        peak = _rss_kib("VmHWM")
    finally:
        worker.shutdown()
    tokens = int(metrics["train/forward_tokens"])
    scored = completion_tokens * batch.num_sequences
    shape = MemoryShape.from_hf_config(read_hf_config(path), name=model)
    layout = Layout(world=1, micro_batch_tokens=tokens, recompute=recompute, dtype="float32",
                    scored_share=scored / tokens)
    measured = (peak - base) * 1024
    return {"model": model, "recompute": recompute, "completion tokens": completion_tokens,
            "micro-batch tokens": tokens, "scored share": scored / tokens, "measured GiB": measured / GIB,
            "step s": step_s, "RSS before step GiB": base / 2 ** 20} | predict(shape, layout, measured)


def predict(shape, layout, measured: float) -> dict:
    """The memory model's columns for one point (trainer/memory.py: activations, logits, backward)."""
    from gspo_ray.trainer.memory import GIB, activation_bytes, backward_bytes, logits_bytes

    act, logits, back = (f(shape, layout) for f in (activation_bytes, logits_bytes, backward_bytes))
    total = act + logits + back
    return {"predicted activations GiB": act / GIB, "predicted logits GiB": logits / GIB,
            "predicted backward GiB": back / GIB, "predicted GiB": total / GIB, "predicted / measured": total / measured}


def run_memory_bench(points=POINTS, default_malloc: bool = False) -> list[dict]:
    """Every point in its own process, one after another; prints the table and writes runs/bench/memory.json."""
    rows = []
    env = os.environ.copy()
    if not default_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    for model, tokens, recompute in points:
        proc = subprocess.run([sys.executable, "-m", "gspo_ray.bench.memory", "--point", model, str(tokens),
                               recompute], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"memory point {model} {tokens} {recompute} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]) | {"malloc": "default" if default_malloc
                                                                          else f"mmap threshold {MMAP_THRESHOLD}"})
        print(markdown_table([rows[-1]]), flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(rows, indent=1))
    text = ("Trainer memory model against measurement (fp32, one rank, one micro-batch; each point a fresh process)\n"
            + markdown_table(rows))
    print(text, flush=True)
    return rows


def repredict(path: Path) -> list[dict]:
    """The model's columns recomputed for the measured points stored in `path` (a memory.json): the measurements
    as they were, the predictions of the memory model as it is now."""
    from gspo_ray.trainer.memory import GIB, Layout, MemoryShape
    from gspo_ray.trainer.model_spec import read_hf_config

    rows = []
    for r in json.loads(Path(path).read_text()):
        shape = MemoryShape.from_hf_config(read_hf_config(model_dir(r["model"])), name=r["model"])
        tokens = r["micro-batch tokens"]
        layout = Layout(world=1, micro_batch_tokens=tokens, recompute=r["recompute"], dtype="float32",
                        scored_share=8 * r["completion tokens"] / tokens)
        rows.append(r | predict(shape, layout, r["measured GiB"] * GIB))
    print(markdown_table(rows))
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--point":
        print(json.dumps(measure_point(sys.argv[2], int(sys.argv[3]), sys.argv[4])), flush=True)
    elif len(sys.argv) == 3 and sys.argv[1] == "--repredict":
        repredict(Path(sys.argv[2]))
    else:
        run_memory_bench(default_malloc="--default-malloc" in sys.argv)
