"""LoRA push benchmark (a table, not a test): an adapter-only push into a LoRA engine vs a full-weight push.

    gspo-ray bench --suite lora
    .venv/bin/python -m gspo_ray.bench.lora_push --hidden 256 --layers 4 --rank 8 --reps 5

Two engines in turn on one tiny dense Qwen2 (one core each time): a plain engine gets the whole checkpoint in
64 MiB buckets (`RolloutWorker.update_weights`, the full fine-tuning push); an engine started with
`rollout.lora_rank` gets a PEFT-named adapter on every linear (written as a PEFT directory, loaded in place).
Each row: MiB pushed, median seconds of `reps` pushes after a warm-up push, and the probe check's max |diff| of the
last push against transformers (+ peft). The trainer-side export is not included (see sync/export_s in a job).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapter(base: Path, rank: int):
    """transformers + peft with a random adapter, and its push (PEFT names, B * alpha / r)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    alpha = 2.0 * rank
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS))
    g = torch.Generator().manual_seed(0)
    push = []
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
                scale = alpha / rank if "lora_B" in name else 1.0  # the trainer folds alpha / r into B
                push.append((name.replace(".default.weight", ".weight"), p.detach().clone() * scale))
    return peft.eval(), push


def _time_pushes(worker, make_buckets, probe, reps: int) -> tuple[float, float, float]:
    """(MiB, median seconds, last probe max diff) of `reps` pushes after one warm-up."""
    worker.update_weights(1, make_buckets(), probe)
    seconds, metrics = [], {}
    for v in range(reps):
        start = time.perf_counter()
        metrics = worker.update_weights(2 + v, make_buckets(), None)
        seconds.append(time.perf_counter() - start)
    check = worker.update_weights(99, make_buckets(), probe)
    return metrics["sync/push_mb"], statistics.median(seconds), check["sync/verify_max_abs_diff"]


def run_lora_push_bench(hidden: int = 256, layers: int = 4, rank: int = 8, reps: int = 5) -> list[tuple]:
    import torch

    from gspo_ray.config import RolloutConfig
    from gspo_ray.models.tiny import make_tiny_model
    from gspo_ray.rollout.weight_sync import (WeightProbe, hf_teacher_forced_logprobs, iter_buckets,
                                              read_checkpoint_weights)
    from gspo_ray.rollout.worker import RolloutWorker

    probe_ids = [2] + [3 + (t * 7) % 19 for t in range(40)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = make_tiny_model("qwen2", Path(tmp) / "base", seed=2, hidden=hidden, layers=layers)
        peft, push = _adapter(base, rank)
        with torch.no_grad(), peft.disable_adapter():
            base_probe = WeightProbe.single(probe_ids, hf_teacher_forced_logprobs(peft, [probe_ids])[0])
        lora_probe = WeightProbe.single(probe_ids, hf_teacher_forced_logprobs(peft, [probe_ids])[0])
        for label, lora_rank in (("full weights", None), (f"adapter r={rank}", rank)):
            cfg = RolloutConfig(max_model_len=128, max_new_tokens=8, group_size=2, lora_rank=lora_rank)
            worker = RolloutWorker(0, base, cfg, run_dir=Path(tmp) / f"run-{lora_rank}", cpu_cores="0")
            try:
                if lora_rank is None:
                    made = lambda: iter_buckets(read_checkpoint_weights(base), 64)  # noqa: E731
                    mib, sec, diff = _time_pushes(worker, made, base_probe, reps)
                else:
                    mib, sec, diff = _time_pushes(worker, lambda: [push], lora_probe, reps)
            finally:
                worker.shutdown()
            rows.append((label, mib, sec, diff))
    print(f"\nLoRA push, tiny Qwen2 hidden {hidden} x {layers} layers, one engine at a time, median of {reps}")
    print(f"{'push':<16}{'MiB':>10}{'seconds':>10}{'probe max|diff|':>18}")
    for label, mib, sec, diff in rows:
        print(f"{label:<16}{mib:>10.3f}{sec:>10.3f}{diff:>18.2e}")
    return rows


def run_lora_decode_bench(model_dir: Path, rank: int = 16, prompts: int = 8, group: int = 8, new_tokens: int = 32,
                          reps: int = 3) -> list[tuple]:
    """Rollout with a served adapter: vLLM's CPU LoRA ops against compat.vllm_cpu_lora's one-product ops, and the
    same engine settings without LoRA; one engine at a time on both cores, median seconds of `reps` generates."""
    import torch
    from transformers import AutoTokenizer

    from gspo_ray.compat.vllm_cpu_lora import apply_lora_fix, undo_lora_fix
    from gspo_ray.config import RolloutConfig
    from gspo_ray.data.records import Prompt
    from gspo_ray.rollout.worker import RolloutWorker

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    texts = [tok.apply_chat_template(
        [{"role": "user", "content": f"Write two sentences about the number {i + 3} and what it counts."}],
        add_generation_prompt=True, tokenize=False) for i in range(prompts)]
    batch = [Prompt(uid=f"p{i}", prompt_ids=tok(t, add_special_tokens=False)["input_ids"])
             for i, t in enumerate(texts)]
    _, push = _adapter(model_dir, rank)

    def timed(worker) -> tuple[float, int, list]:
        worker.generate(batch, seed=0)  # warm-up
        seconds, samples = [], []
        for _ in range(reps):
            start = time.perf_counter()
            samples = worker.generate(batch, seed=1)
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds), sum(len(s.completion_ids) for s in samples), samples

    rows, served = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, lora_rank in ((f"adapter r={rank}", rank), ("no LoRA", None)):
            cfg = RolloutConfig(max_model_len=256, max_new_tokens=new_tokens, group_size=group, temperature=0.7,
                                lora_rank=lora_rank)
            worker = RolloutWorker(0, model_dir, cfg, run_dir=Path(tmp) / f"run-{lora_rank}", cpu_cores="0-1")
            try:
                if lora_rank is None:
                    sec, tokens, _ = timed(worker)
                    rows.append((label, sec, tokens))
                    continue
                worker.update_weights(1, [push], None)
                for ops, bind in (("vLLM's ops", undo_lora_fix), ("one product", apply_lora_fix)):
                    bind()
                    sec, tokens, samples = timed(worker)
                    served[ops] = samples
                    rows.append((f"{label}, {ops}", sec, tokens))
            finally:
                apply_lora_fix()
                worker.shutdown()
    same = [(a, b) for a, b in zip(*served.values()) if a.completion_ids == b.completion_ids]
    diff = max((abs(x - y) for a, b in same for x, y in zip(a.logprobs, b.logprobs)), default=float("nan"))
    print(f"\nLoRA-served rollout, {model_dir.name}, {prompts} prompts x {group}, <= {new_tokens} new tokens, "
          f"median of {reps} ({torch.get_num_threads()} threads)")
    print(f"{'engine':<34}{'seconds':>10}{'tokens':>8}")
    for label, sec, tokens in rows:
        print(f"{label:<34}{sec:>10.2f}{tokens:>8}")
    print(f"same completions under both ops: {len(same)}/{len(served[next(iter(served))])}, "
          f"their log-probs' max |diff| {diff:.2e}")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--decode-model", type=Path, default=None,
                   help="also time LoRA-served rollouts on this HF model (vLLM's LoRA ops vs the one-product ops)")
    a = p.parse_args(argv)
    run_lora_push_bench(a.hidden, a.layers, a.rank, a.reps)
    if a.decode_model is not None:
        run_lora_decode_bench(a.decode_model)


if __name__ == "__main__":
    main()
