"""Rollout benchmark (a table, not a test): generation tokens/s of one engine and weight-push time per MB.

    gspo-ray bench --suite rollout               # tiny MoE, 64 prompts x 8 samples x 16 tokens
    .venv/bin/python -m gspo_ray.bench.rollout --reps 5 --push-hidden 256 --push-experts 8

Rows:
- `engine.generate`: our step loop (one request per sample, delta outputs, abortable), 64 x n=8, seeded.
- `LLM.generate n=8`: vLLM's own batch call on the same engine (final outputs only, not abortable), for scale.
- `push`: `RolloutWorker.update_weights` of a checkpoint in buckets, seconds and s/MiB (fp32 weights).
Numbers are medians after one warm-up round. The machine's other load shows up directly in them.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def _prompts(k: int):
    from gspo_ray.data.records import Prompt

    return [Prompt(uid=f"b{i}", prompt_ids=[2] + [3 + (i * 7 + t) % 19 for t in range(6)]) for i in range(k)]


def bench_generate(worker, num_prompts: int, n: int, tokens: int, reps: int) -> list[tuple[str, float, float]]:
    """(row name, tokens/s median, seconds median) for our loop and for vLLM's LLM.generate."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from gspo_ray.rollout.engine import SamplingSettings

    engine, prompts = worker.engine, _prompts(num_prompts)
    sampling = SamplingSettings(max_new_tokens=tokens)
    rows = []

    def ours(seed):
        return sum(s.num_tokens for s in engine.generate(prompts, n, sampling, seed=seed))

    def vllm_batch(seed):
        params = SamplingParams(n=n, logprobs=0, max_tokens=tokens, seed=seed)
        outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p.prompt_ids) for p in prompts], params,
                                   use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    for name, fn in ((f"engine.generate {num_prompts}x n={n}", ours),
                     (f"LLM.generate {num_prompts}x n={n}", vllm_batch)):
        fn(0)  # warm-up (first call compiles the sampler's log-prob kernel)
        rates, secs = [], []
        for r in range(reps):
            start = time.perf_counter()
            count = fn(r + 1)
            secs.append(time.perf_counter() - start)
            rates.append(count / secs[-1])
        rows.append((name, statistics.median(rates), statistics.median(secs)))
    return rows


def bench_push(worker, model_dir: Path, bucket_mbs: list[float], reps: int) -> list[tuple[str, float, float, float]]:
    """(row name, MiB, seconds median, s/MiB) per bucket size."""
    from gspo_ray.rollout.weight_sync import iter_buckets, read_checkpoint_weights

    weights = list(read_checkpoint_weights(model_dir))  # in memory: time the push, not the disk
    rows = []
    for mb in bucket_mbs:
        secs, size = [], 0.0
        for r in range(reps + 1):
            m = worker.update_weights(r, iter_buckets(weights, mb))
            if r:  # first round is warm-up
                secs.append(m["sync/push_s"])
            size = m["sync/push_mb"]
        med = statistics.median(secs)
        rows.append((f"push bucket={mb:g} MiB", size, med, med / size))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=128, help="tiny MoE for generation (head_dim must be >= 32)")
    ap.add_argument("--push-hidden", type=int, default=256, help="MoE used for the push rows (bigger: more MB)")
    ap.add_argument("--push-layers", type=int, default=4)
    ap.add_argument("--push-experts", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="work directory (default: a temp dir)")
    args = ap.parse_args(argv)

    from gspo_ray.config import RolloutConfig
    from gspo_ray.models.tiny import make_tiny_model
    from gspo_ray.rollout.worker import RolloutWorker

    root = args.out or Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    cfg = RolloutConfig(max_model_len=128, max_new_tokens=args.tokens, group_size=args.n)
    gen_model = make_tiny_model("qwen3_moe", root / "gen_model", hidden=args.hidden)
    push_model = make_tiny_model("qwen3_moe", root / "push_model", hidden=args.push_hidden,
                                 layers=args.push_layers, experts=args.push_experts)

    start = time.perf_counter()
    worker = RolloutWorker(0, gen_model, cfg, run_dir=root / "run", cpu_cores="0")
    start_s = time.perf_counter() - start
    gen_rows = bench_generate(worker, args.prompts, args.n, args.tokens, args.reps)
    worker.shutdown()
    worker = RolloutWorker(0, push_model, cfg, run_dir=root / "run", cpu_cores="0")
    push_rows = bench_push(worker, push_model, [1.0, 16.0, 256.0], args.reps)
    worker.shutdown()

    print(f"\nengine start (in-process, first in this process, incl. vLLM imports): {start_s:.1f} s")
    print(f"{'generation':<34}{'tokens/s':>12}{'s/batch':>10}")
    for name, rate, sec in gen_rows:
        print(f"{name:<34}{rate:>12,.0f}{sec:>10.2f}")
    print(f"\n{'weight push':<34}{'MiB':>8}{'s':>10}{'s/MiB':>10}")
    for name, size, sec, per in push_rows:
        print(f"{name:<34}{size:>8.1f}{sec:>10.3f}{per:>10.4f}")


if __name__ == "__main__":
    main()
