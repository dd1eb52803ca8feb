"""The scale model's memory rows: per-rank trainer memory and the layout the planner picks, at the shapes users run
(`gspo-ray bench --suite scale` prints them after its tables; docs/scale.md, "Memory at the shapes users run").

Per shape: the model (MemoryShape: Qwen3's from their config.json sizes; the DeepSeek-V3-like MoE and the
Qwen3.5-35B-A3B-like hybrid by hand, since the trainer has no family for them yet: MLA's and the linear-attention
layers' parameters counted by hand, their activations approximated by GQA layers of the same widths), the trainer
GPUs, H100s of 80 GiB, bf16, the distributed optimizer, rows of one prompt group (16 completions) at the
completion length. What the planner picks (trainer/layout_plan.fitting_layouts: TP, EP, CP, PP, recompute,
micro_batch_tokens, optimizer offload; its rule: the shortest predicted step, then the least communication) and its
terms, with PP those of the busiest stage; or that none fits, with the smallest per-rank total any layout reaches
and the fewest GPUs on which one fits. Model numbers: the CP and PP code never ran on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

from gspo_ray.trainer.layout_plan import fitting_layouts, least_memory, step_seconds
from gspo_ray.trainer.memory import GIB, Layout, MemoryShape

DEVICE_GIB = 80
GROUP, PROMPT = 16, 1024  # a prompt group's completions; prompt tokens

QWEN3_30B = MemoryShape(name="Qwen3-30B-A3B", vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4,
                        head_dim=128, experts=128, top_k=8, moe_ffn=768, moe_layers=48, qk_norm=True)
QWEN3_235B = MemoryShape(name="Qwen3-235B-A22B", vocab=151936, hidden=4096, layers=94, heads=64, kv_heads=4,
                         head_dim=128, experts=128, top_k=8, moe_ffn=1536, moe_layers=94, qk_norm=True)
# DeepSeek-V3 (671B, by hand): 61 layers (3 dense, ffn 18432), 256 routed experts top-8 of width 2048 and one shared,
# MLA attention (q_lora 1536, kv_lora 512, 128 heads of 128 + 64 rope dims, v 128): 187.1M parameters a layer
DEEPSEEK_V3 = MemoryShape(name="DeepSeek-V3-671B-like", vocab=129280, hidden=7168, layers=61, heads=128,
                          kv_heads=128, head_dim=192, ffn=18432, experts=256, top_k=8, moe_ffn=2048, moe_layers=58,
                          shared_ffn=2048, attn_params=7168 * 1536 + 1536 * 128 * 192 + 7168 * 576
                          + 512 * 128 * 256 + 128 * 128 * 7168, params_by_hand=True)
# Qwen3.5-35B-A3B-like hybrid (by hand): 40 layers (3 of 4 linear attention, 1 gated full attention: counted alike,
# 16 heads / 2 kv heads of 256), 256 experts top-8 of width 512 and one shared of 512
QWEN35_35B = MemoryShape(name="Qwen3.5-35B-A3B-like", vocab=248320, hidden=2048, layers=40, heads=16, kv_heads=2,
                         head_dim=256, experts=256, top_k=8, moe_ffn=512, moe_layers=40, shared_ffn=512,
                         qk_norm=True, params_by_hand=True)


@dataclass(frozen=True)
class Job:
    shape: MemoryShape
    gpus: int
    completion: int


JOBS = (Job(QWEN3_30B, 8, 8192), Job(QWEN3_30B, 8, 16384), Job(QWEN3_30B, 8, 32768), Job(QWEN3_235B, 64, 16384),
        Job(QWEN3_235B, 64, 131072), Job(QWEN3_235B, 16, 16384), Job(DEEPSEEK_V3, 256, 16384),
        Job(QWEN35_35B, 8, 16384))


def plan_job(job: Job, prompts_per_step: int = 32, grads_fp32_only: bool = False) -> dict:
    """One row: the cheapest layout that fits DEVICE_GIB, its terms and step time; or the least memory reached.
    grads_fp32_only: bf16 gradient buffers are not among the candidates (trainer.grad_reduce_in_fp32 kept true)."""
    row_tokens = PROMPT + job.completion  # one sequence: never split over micro-batches
    base = Layout(world=job.gpus, micro_batch_tokens=max(32768, PROMPT + GROUP * job.completion // 2),
                  dtype="bfloat16", grads_fp32=True)
    batch = prompts_per_step * GROUP * row_tokens
    pairs = prompts_per_step * (PROMPT * (PROMPT + 1) / 2 + GROUP * job.completion * (PROMPT + job.completion / 2))
    bf16 = not grads_fp32_only
    fits = fitting_layouts(job.shape, base, job.gpus, DEVICE_GIB * GIB, batch, 1, row_tokens, pairs, bf16)
    out = {"model": job.shape.name, "by hand": job.shape.params_by_hand, "params B": job.shape.total_params / 1e9,
           "gpus": job.gpus, "completion": job.completion}
    if fits:
        layout, terms = fits[0]
        step = step_seconds(job.shape, layout, batch, pairs)
    else:
        (layout, terms), step = least_memory(job.shape, base, job.gpus, row_tokens, batch, bf16), None
        out["fewest GPUs"] = fewest_gpus(job, base, batch, row_tokens, pairs, bf16)
    return out | {"layout": layout.describe() if fits else None, "parallel": layout_columns(layout),
                  "stage": terms.stage, "terms": {k: v / GIB for k, v in terms.terms.items()},
                  "total GiB": terms.total / GIB, "step s": step}


def fewest_gpus(job: Job, base: Layout, batch: int, row_tokens: int, pairs: float, bf16_grads: bool = True
                ) -> int | None:
    """The fewest trainer GPUs (a multiple of 8, up to 4 x the job's) on which some layout fits DEVICE_GIB."""
    for gpus in range(job.gpus + 8, 4 * job.gpus + 1, 8):
        if fitting_layouts(job.shape, base, gpus, DEVICE_GIB * GIB, batch, 1, row_tokens, pairs, bf16_grads):
            return gpus
    return None


def layout_columns(layout: Layout) -> dict:
    return {"tp": layout.tp, "ep": layout.ep, "cp": layout.cp, "pp": layout.pp, "dp": layout.dp,
            "recompute": layout.recompute, "micro_batch_tokens": layout.micro_batch_tokens,
            "offload": layout.offload, "grad_buffers": "bf16" if layout.bf16_grads else "fp32"}


def memory_table(rows: list[dict]) -> str:
    head = ("| model | params B | trainer GPUs | completion | TP | EP | CP | PP | DP | recompute | micro_batch_tokens | "
            "offload | grad buffers | weights | main | grads | optimizer | activations | logits | backward | GiB a rank (stage) | "
            "step s |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        t, p = r["terms"], r["parallel"]
        step = (f"{r['step s']:.0f}" if r["step s"] is not None else
                f"none fits (least reached; fits from {r['fewest GPUs']} GPUs)")
        name = r["model"] + (" (params by hand)" if r["by hand"] else "")
        stage = f" ({r['stage']})" if p["pp"] > 1 else ""
        lines.append(f"| {name} | {r['params B']:.0f} | {r['gpus']} | {r['completion']} | {p['tp']} | {p['ep']} | "
                     f"{p['cp']} | {p['pp']} | {p['dp']} | {p['recompute']} | {p['micro_batch_tokens']} | "
                     f"{'yes' if p['offload'] else 'no'} | {p['grad_buffers']} | "
                     f"{t['weights']:.1f} | {t['main_params']:.1f} | {t['grads']:.1f} | {t['optimizer']:.1f} | "
                     f"{t['activations']:.1f} | {t['logits']:.1f} | {t['backward']:.1f} | {r['total GiB']:.1f}{stage} "
                     f"| {step} |")
    return "\n".join(lines)


def run_memory_rows() -> list[dict]:
    rows = [plan_job(job) for job in JOBS]
    print("\nTrainer memory per rank at the shapes users run (bf16, 80 GiB H100s):\n" + memory_table(rows))
    return rows


if __name__ == "__main__":
    run_memory_rows()
