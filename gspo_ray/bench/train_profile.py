"""`gspo-ray bench --suite profile`: where the SmolLM2 train step's time goes, by op class (torch profiler).

One in-process trainer (no Ray) on SmolLM2-135M-Instruct with the recipe's trainer settings (and a third row with
LoRA: the base frozen, the lora-vs-full suite's rank-16 adapters on every linear), a batch shaped like the
recipe's step (8 prompt groups x 8 completions: the chat-template prompts of the repeat task, completions of 15-31
random tokens, ~23 on average), one warm-up step, then `--steps` profiled train steps, with group rows
(`shared_prefix`) on and off. Prints per layout: the step's seconds, the tokens forwarded, useful GFLOP/s (6 x
non-embedding parameters x forwarded tokens + the output layer on the scored tokens) against this machine's 2-thread
fp32 matmul peak (measured here, best of 3), the process's peak RSS during the timed steps (VmHWM reset after
the warm-up), and, from one more step traced by the profiler (which slows it), the
CPU self-time of aten ops split by op class: matmul, attention (softmax, masking, the batched products of scores
and values), norms and elementwise, optimizer, copies and layout, other; and the traced time outside aten ops
(Python, autograd bookkeeping).

At real lengths (`--completion-tokens N`, `--groups G`): G prompt groups x 8 completions of exactly N random
tokens, group rows only, micro_batch_tokens 8 x the longest row (one prompt group per micro-batch), one untimed
old-log-prob forward then one timed train step, no profiler; prints the step's
seconds, the tokens forwarded and the distinct tokens of the batch (prompts once per group, completions), and the
process's peak RSS over the log-prob forward and the step (VmHWM reset before them).
"""
from __future__ import annotations

import os
import random
import time
from collections import defaultdict
from pathlib import Path

from gspo_ray.bench.common import SMOLLM2_RECIPE, markdown_table

# op-name fragments -> class (first match wins); self CPU time of every aten op is attributed to one class
OP_CLASSES = [
    ("attention", ("softmax", "_softmax", "masked_fill", "baddbmm", "bmm", "scaled_dot_product", "flash_attention",
                   "_efficient_attention")),
    ("matmul", ("addmm", "aten::mm", "matmul", "aten::linear", "aten::dot")),
    ("optimizer", ("_foreach", "adam", "lerp", "addcdiv", "addcmul", "sqrt")),
    ("copies/layout", ("copy_", "clone", "contiguous", "cat", "index", "gather", "scatter", "to_copy", "_to_copy",
                       "transpose", "permute", "view", "reshape", "expand", "narrow", "select", "slice", "stack",
                       "empty", "zeros", "fill_", "split", "unbind", "nonzero", "where")),
    ("norms/elementwise", ("mul", "add", "sub", "div", "silu", "pow", "rsqrt", "mean", "sum", "neg", "exp", "log",
                           "rms", "norm", "sigmoid", "tanh", "cos", "sin", "max", "min", "clamp", "abs", "sign")),
]


def matmul_peak_gflops(n: int = 2048, reps: int = 3) -> float:
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(reps))
    return 2 * n ** 3 / best / 1e9


def reset_peak_rss() -> None:
    """Start this process's VmHWM (peak resident set) afresh from its current RSS (Linux clear_refs, mode 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_gib() -> float:
    """This process's VmHWM since the last reset_peak_rss (or its start), GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2 ** 20
    raise RuntimeError("no VmHWM in /proc/self/status")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def recipe_batch(model_dir: Path, groups: int = 8, group_size: int = 8, seed: int = 0,
                 completion_tokens: int | None = None):
    """A TrainBatch shaped like the recipe's step: real chat prompts, random completions of 15-31 tokens (or of
    exactly `completion_tokens`)."""

    from gspo_ray.config import load_config
    from gspo_ray.data.prompts import PromptSource, load_tokenizer
    from gspo_ray.data.records import Sample, collate

    cfg = load_config(SMOLLM2_RECIPE, ["model.packaged=null", f"model.path={model_dir}"])
    tokenizer = load_tokenizer(model_dir)
    prompts = PromptSource.from_config(cfg.data, tokenizer, max_new_tokens=cfg.rollout.max_new_tokens,
                                       max_model_len=cfg.rollout.max_model_len).take(groups)
    rng = random.Random(seed)
    samples, advs = [], []
    for p in prompts:
        for j in range(group_size):
            n = completion_tokens or rng.randint(15, 31)
            samples.append(Sample(prompt_uid=p.uid, sample_index=j, prompt_ids=p.prompt_ids,
                                  completion_ids=[rng.randrange(3, len(tokenizer)) for _ in range(n)],
                                  logprobs=[0.0] * n, loss_mask=[1] * n, versions=[0] * n, finish_reason="stop"))
            advs.append([rng.gauss(0.0, 1.0)] * n)
    batch = collate(samples, advs)
    return batch, cfg


def op_class(name: str) -> str:
    low = name.lower()
    for cls, keys in OP_CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def profile_layout(model_dir: Path, shared: bool, steps: int, port: int, lora: bool = False) -> dict:
    """One layout's row. lora: the base frozen, rank-16 adapters on every linear (the lora-vs-full suite's): the
    useful FLOPs drop the weight-gradient matmuls (4 x params x tokens instead of 6) plus the adapters' own."""
    from torch.profiler import ProfilerActivity, profile

    from gspo_ray.bench.smollm2 import LORA_ALPHA, LORA_RANK, nonembedding_params
    from gspo_ray.config.lora import LoRAConfig
    from gspo_ray.trainer.worker import TrainerWorker

    batch, cfg = recipe_batch(model_dir)
    update = {"shared_prefix": shared, "router_churn_every": 0, "lr": 1e-7}
    if lora:
        update["lora"] = LoRAConfig(rank=LORA_RANK, alpha=LORA_ALPHA)
    tcfg = cfg.trainer.model_copy(update=update)
    worker = TrainerWorker(0, 1, "127.0.0.1", port, str(model_dir), tcfg, cfg.algorithm)
    try:
        trainable = sum(p.numel() for p in worker.gpt.parameters() if p.requires_grad)
        batch.old_logp = worker.compute_logprobs(batch)
        worker.train_step(batch)  # warm-up
        reset_peak_rss()
        t0 = time.perf_counter()
        for _ in range(steps):
            metrics = worker.train_step(batch)
        step_s = (time.perf_counter() - t0) / steps
        peak_gib = peak_rss_gib()
        with profile(activities=[ProfilerActivity.CPU]) as prof:  # one more step, traced (the tracer slows it)
            t0 = time.perf_counter()
            worker.train_step(batch)
            traced_s = time.perf_counter() - t0
    finally:
        worker.shutdown()
    by_class: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.key.startswith("aten::"):
            by_class[op_class(evt.key)] += evt.self_cpu_time_total / 1e6
    body, head = nonembedding_params(model_dir)
    scored = float(batch.loss_mask.sum())
    tokens = metrics["train/forward_tokens"]
    if lora:  # forward + input gradient of the frozen base, forward + both gradients of the adapters
        flops = 4 * body * tokens + 4 * head * scored + 6 * trainable * tokens
    else:
        flops = 6 * body * tokens + 6 * head * scored
    total_ops = sum(by_class.values())
    layout = "group rows" if shared else "one row per sample"
    return {"layout": layout + (", LoRA" if lora else ""), "step s": step_s,
            "tokens forwarded": metrics["train/forward_tokens"], "GFLOP/s": flops / step_s / 1e9,
            "peak RSS GiB": peak_gib, "traced step s": traced_s, **{f"{c} s": by_class.get(c, 0.0) for c, _ in OP_CLASSES},
            "other s": by_class.get("other", 0.0), "outside aten ops s": max(traced_s - total_ops, 0.0)}


def profile_long(model_dir: Path, completion_tokens: int, groups: int, port: int, recompute: str | None = None
                 ) -> dict:
    """One train step with group rows on `groups` prompts x 8 completions of `completion_tokens` tokens: seconds,
    tokens forwarded, distinct tokens, peak RSS (see the module docstring)."""
    from gspo_ray.trainer.worker import TrainerWorker

    batch, cfg = recipe_batch(model_dir, groups=groups, completion_tokens=completion_tokens)
    # micro_batch_tokens: 8 padded rows of the longest, so one prompt group fits a micro-batch (the recipe's 640
    # is below one such row, which its config validation would refuse)
    tcfg = cfg.trainer.model_copy(update={"shared_prefix": True, "router_churn_every": 0, "lr": 1e-7,
                                          "micro_batch_tokens": 8 * int(batch.lengths.max()),
                                          "recompute": recompute or cfg.trainer.recompute})
    worker = TrainerWorker(0, 1, "127.0.0.1", port, str(model_dir), tcfg, cfg.algorithm)
    try:
        reset_peak_rss()
        batch.old_logp = worker.compute_logprobs(batch)
        t0 = time.perf_counter()
        metrics = worker.train_step(batch)
        step_s = time.perf_counter() - t0
        peak_gib = peak_rss_gib()
    finally:
        worker.shutdown()
    prompts = {uid.rsplit("/", 1)[0]: int(n) - completion_tokens for uid, n in zip(batch.uids, batch.lengths)}
    return {"layout": "group rows", "recompute": tcfg.recompute, "groups x completions": f"{groups} x 8",
            "completion tokens": completion_tokens,
            "step s": step_s, "tokens forwarded": metrics["train/forward_tokens"],
            "distinct tokens": sum(prompts.values()) + completion_tokens * batch.num_sequences,
            "peak RSS GiB": peak_gib}


def run_train_profile(steps: int = 2, model_dir: Path = Path("runs/models/smollm2-135m-instruct"),
                      completion_tokens: int | None = None, groups: int | None = None,
                      recompute: str | None = None) -> str:
    """The profile table (the recipe's batch), or with completion_tokens / groups set the long-completion row."""
    import torch

    from gspo_ray.models.gguf import ensure_imported
    from gspo_ray.trainer.parallel import free_port

    ensure_imported(model_dir)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    if completion_tokens is not None or groups is not None:
        row = profile_long(model_dir, completion_tokens or 23, groups or 8, free_port(), recompute)
        text = (f"SmolLM2 train step at real lengths, fp32, {torch.get_num_threads()} threads, one step after the "
                f"old-log-prob forward\n{markdown_table([row])}")
        print(text, flush=True)
        return text
    peak = matmul_peak_gflops()
    rows = [profile_layout(model_dir, shared, steps, free_port(), lora) for shared, lora in
            ((True, False), (False, False), (True, True))]
    text = (f"SmolLM2 train step, 8 x 8 rows, fp32, {torch.get_num_threads()} threads, mean of {steps} steps; "
            f"2048^2 fp32 matmul peak here {peak:.0f} GFLOP/s\n{markdown_table(rows)}")
    print(text, flush=True)
    return text
