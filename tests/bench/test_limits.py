"""The limit column's work model (bench/limits.py): the FLOP and byte counts are what the formulas say for SmolLM2's
shapes, the time at the peak is the roofline (the larger of compute and bytes), and the probes return rates."""
from __future__ import annotations

import pytest

from gspo_ray.bench.limits import limit_rows, measure_peaks, phase_work

BODY, HEAD = 106_203_456, 28_311_552  # SmolLM2-135M: non-embedding parameters, output layer (49152 x 576)


def _work():
    return phase_work(BODY, HEAD, forward_tokens=1791, scored_tokens=1472, decode_tokens=1472, prefill_tokens=328,
                      decode_steps=23, bytes_per_param=4, push_bytes=513e6)


def test_smollm2_step_counts():
    work = _work()
    train_flops, train_bytes = work["train"]
    assert train_flops == 6 * BODY * 1791 + 6 * HEAD * 1472 and train_bytes == 0
    assert 1.3e12 < train_flops < 1.5e12  # the issue's ~1.45 TFLOP for this step
    flops, nbytes = work["rollout"]
    assert flops == 2 * BODY * (1472 + 328) + 2 * HEAD * 1472
    assert nbytes == (BODY + HEAD) * 4 * 23  # 538 MB of fp32 weights read per decode step
    assert work["sync"] == (0.0, 513e6)
    # bf16 halves the bytes, not the FLOPs
    half = phase_work(BODY, HEAD, forward_tokens=1791, scored_tokens=1472, decode_tokens=1472, prefill_tokens=328,
                      decode_steps=23, bytes_per_param=2, push_bytes=0)
    assert half["rollout"] == (flops, nbytes / 2)


def test_limit_is_the_roofline():
    rows = {r["phase"]: r for r in limit_rows(_work(), {"rollout": 12.0, "train": 20.0, "sync": 0.0},
                                              peak_gflops=150.0, copy_gbs=10.0)}
    train = rows["train"]
    assert train["limit_s"] == pytest.approx(_work()["train"][0] / 150e9)
    assert train["pct"] == pytest.approx(100 * train["limit_s"] / 20.0)
    rollout = rows["rollout"]  # 0.42 TFLOP at 150 GFLOP/s (2.8 s) vs 12.4 GB at 10 GB/s (1.24 s): compute bound
    assert rollout["limit_s"] == pytest.approx(max(rollout["tflop"] * 1e12 / 150e9, rollout["gb"] / 10.0))
    assert rollout["limit_s"] == pytest.approx(rollout["tflop"] * 1e12 / 150e9)
    slow_copy = {r["phase"]: r for r in limit_rows(_work(), {"rollout": 12.0}, 150.0, 1.0)}["rollout"]
    assert slow_copy["limit_s"] == pytest.approx(slow_copy["gb"] / 1.0)  # bandwidth bound now
    assert rows["sync"]["limit_s"] == pytest.approx(0.0513) and rows["sync"]["pct"] is None  # no time measured


def test_probes_return_rates():
    peaks = measure_peaks(threads=1, n=128, copy_mib=4, reps=1)
    assert set(peaks) == {"fp32_gflops", "bf16_gflops", "copy_gbs"} and min(peaks.values()) > 0


def test_the_smollm2_bench_counts_forward_tokens_once_at_dp_2():
    from gspo_ray.bench.smollm2 import train_work

    # a DP 2 job's steps: train/forward_tokens is already the sum of both ranks (dp_token_metrics), so the step
    # forwarded 100 tokens, not 2 x 100; the first row is warm-up and was dropped by the caller
    steady = [{"train/forward_tokens": 100.0, "rollout/tokens": 40.0, "train/dp_imbalance": 1.0}] * 3
    tokens, flops = train_work(steady, BODY, HEAD)
    assert tokens == 100.0 and flops == 6 * BODY * 100 + 6 * HEAD * 40
