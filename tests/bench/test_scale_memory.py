"""The scale model's memory rows (bench/scale_memory.py): every shape of the issue planned on 80 GiB H100s, over TP,
EP, CP, PP, recompute and offload."""
from __future__ import annotations

from gspo_ray.bench.scale_memory import DEVICE_GIB, JOBS, QWEN3_30B, QWEN3_235B, plan_job
from gspo_ray.trainer.layout_plan import USABLE_SHARE
from gspo_ray.trainer.memory import GIB, Layout, rank_memory


def test_each_shape_gets_a_layout_that_fits_or_says_why_none_does():
    rows = [plan_job(job) for job in JOBS]
    assert [r["model"] for r in rows][:3] == ["Qwen3-30B-A3B"] * 3
    for job, r in zip(JOBS, rows):
        assert r["total GiB"] == sum(r["terms"].values())
        assert r["layout"] is not None and r["total GiB"] <= DEVICE_GIB and r["step s"] > 0, r
        # bf16 gradient buffers only where fp32 ones cannot fit: Qwen3-235B-A22B on 16 GPUs, whose bf16 weights
        # and fp32 gradient buffer alone (6 bytes a parameter) exceed the usable device whatever the layout
        needs_bf16_grads = (job.shape, job.gpus) == (QWEN3_235B, 16)
        assert (r["parallel"]["grad_buffers"] == "bf16") == needs_bf16_grads, r
    assert 6 * QWEN3_235B.total_params / 16 > USABLE_SHARE * DEVICE_GIB * GIB
    fp32_only = plan_job(JOBS[5], grads_fp32_only=True)
    assert fp32_only["layout"] is None and fp32_only["fewest GPUs"] == 32, fp32_only
    # 32k-token completions of Qwen3-30B-A3B fit on 8 GPUs by context parallelism, without recompute
    assert rows[2]["parallel"]["cp"] > 1 and rows[2]["parallel"]["recompute"] == "none", rows[2]
    # longer completions never get a cheaper step on the same GPUs
    steps = [r["step s"] for r in rows[:3] if r["step s"] is not None]
    assert steps == sorted(steps)


def test_the_review_layout_does_not_fit_and_the_planned_one_does():
    review = rank_memory(QWEN3_30B, Layout(world=8, tp=2, ep=4, micro_batch_tokens=32768, dtype="bfloat16"))
    assert review.total > DEVICE_GIB * GIB
    row = plan_job(JOBS[1])  # 16k-token completions on 8 GPUs
    assert row["layout"] is not None and row["total GiB"] <= DEVICE_GIB
