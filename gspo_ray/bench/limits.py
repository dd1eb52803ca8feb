"""The limit column: each phase's work (FLOPs, bytes), its time at this machine's peak, and the share reached.

    peaks = measure_peaks()                                       # before the run, and again after it
    work = phase_work(body, head, forward_tokens=..., ...)        # pure: {"rollout": (flops, bytes), ...}
    rows = limit_rows(work, {"rollout": 11.6, ...}, peaks)        # seconds at the peak and % of it reached

The work model (what a phase must do at the least; every figure is a lower bound on its time):
- train: 6 x non-embedding parameters x forwarded tokens (forward 2, backward 4) + 6 x the output layer's
  parameters x scored (generated) tokens; bytes: not counted (the trainer's matmuls are compute bound).
- rollout: 2 x non-embedding parameters x (decode + prefill tokens) + 2 x the output layer x decode tokens (a
  prefill computes logits at its last position only); bytes: every weight read once per decode step, with the
  decode steps taken as the mean completion length (at least that many steps run: a lower bound).
- sync: the bytes pushed (one copy of every weight at the least); no FLOPs.
A phase's time at the peak is the roofline: max(FLOPs / matmul peak, bytes / copy bandwidth). The peaks come from
probes in the same run: a 2-thread 2048^2 matmul in fp32 and in bf16 (best of 3; a dtype without a fast kernel
here, whose 2048^2 product would take over 2 s, is rated by a 512^2 one) and a 2-thread copy of 256 MiB (bytes read
+ written per second, best of 3), measured before and after the run; the limit uses the better of the two probes of
the run's dtype (the machine's other load lowers either).
"""
from __future__ import annotations

import time

PHASES = ("rollout", "train", "sync")


def phase_work(body_params: int, head_params: int, *, forward_tokens: float, scored_tokens: float,
               decode_tokens: float, prefill_tokens: float, decode_steps: float, bytes_per_param: int,
               push_bytes: float) -> dict[str, tuple[float, float]]:
    """{phase: (FLOPs, bytes)} of one step under the model in the module docstring.

    body_params: non-embedding parameters; head_params: the output layer's (vocab x hidden; tied or not, it is
    read and multiplied once per logit row). forward_tokens: tokens the trainer's forwards computed; scored_tokens:
    the tokens the loss scores; decode_tokens / prefill_tokens: generated tokens / prompt tokens the engine ran
    (a group's shared prompt once); decode_steps: engine decode steps (weights read once each)."""
    weight_bytes = (body_params + head_params) * bytes_per_param
    train = 6 * body_params * forward_tokens + 6 * head_params * scored_tokens
    rollout = 2 * body_params * (decode_tokens + prefill_tokens) + 2 * head_params * decode_tokens
    return {"rollout": (float(rollout), float(weight_bytes * decode_steps)), "train": (float(train), 0.0),
            "sync": (0.0, float(push_bytes))}


def limit_rows(work: dict[str, tuple[float, float]], measured_s: dict[str, float], peak_gflops: float,
               copy_gbs: float) -> list[dict]:
    """Per phase: its FLOPs and bytes, the seconds they take at the peak (roofline), the measured seconds and the
    % of the peak reached (limit / measured; None where the phase took no time)."""
    rows = []
    for phase in PHASES:
        flops, nbytes = work[phase]
        limit = max(flops / (peak_gflops * 1e9), nbytes / (copy_gbs * 1e9))
        took = measured_s.get(phase) or 0.0
        rows.append({"phase": phase, "tflop": flops / 1e12, "gb": nbytes / 1e9, "limit_s": limit,
                     "measured_s": took, "pct": 100.0 * limit / took if took > 0 else None})
    return rows


def best_of(fn, reps: int) -> float:
    """Seconds of the fastest of `reps` calls of fn after one warm-up call (a shared host's waits excluded)."""
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_peaks(threads: int = 2, n: int = 2048, copy_mib: int = 256, reps: int = 3,
                  max_probe_s: float = 2.0) -> dict[str, float]:
    """{"fp32_gflops", "bf16_gflops", "copy_gbs"} of this machine now, at `threads` torch threads. A dtype whose
    n^2 product would take over `max_probe_s` (judged from a 512^2 one) is rated at 512^2."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = {}
        for key, dtype in (("fp32_gflops", torch.float32), ("bf16_gflops", torch.bfloat16)):
            # a 512^2 product first: where the dtype has no fast kernel (bf16 without AVX512-BF16/AMX took 70 s
            # per 2048^2 product here) its rate is reported from that size instead of the full probe
            small = min(n, 512)
            a, b = torch.randn(small, small, dtype=dtype), torch.randn(small, small, dtype=dtype)
            rate = 2 * small ** 3 / best_of(lambda: torch.mm(a, b), 1) / 1e9
            if 2 * n ** 3 / (rate * 1e9) <= max_probe_s:
                a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
                rate = 2 * n ** 3 / best_of(lambda: torch.mm(a, b), reps) / 1e9
            out[key] = rate
        src = torch.ones(copy_mib * 2 ** 20 // 4)
        dst = torch.empty_like(src)
        out["copy_gbs"] = 2 * src.numel() * 4 / best_of(lambda: dst.copy_(src), reps) / 1e9
        return out
    finally:
        torch.set_num_threads(before)


def format_limits(rows: list[dict], label: str) -> str:
    from gspo_ray.bench.common import table_head

    lines = table_head("| phase | TFLOP | GB moved | s at the peak | s measured | % of the peak |")
    for r in rows:
        pct = "-" if r["pct"] is None else f"{r['pct']:.0f}%"
        lines.append(f"| {r['phase']} | {r['tflop']:.3f} | {r['gb']:.2f} | {r['limit_s']:.2f} | "
                     f"{r['measured_s']:.2f} | {pct} |")
    return f"limit column ({label})\n" + "\n".join(lines)


def format_peaks(before: dict[str, float], after: dict[str, float]) -> str:
    return ("peaks (2 threads): fp32 matmul {0:.0f} -> {1:.0f} GFLOP/s, bf16 matmul {2:.1f} -> {3:.1f} GFLOP/s, "
            "copy {4:.1f} -> {5:.1f} GB/s (before -> after the run)").format(
        before["fp32_gflops"], after["fp32_gflops"], before["bf16_gflops"], after["bf16_gflops"],
        before["copy_gbs"], after["copy_gbs"])
