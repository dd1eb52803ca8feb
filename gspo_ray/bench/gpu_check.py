"""`make gpu-check` (scripts/gpu_check.sh): the trainer on one lent GPU, with torch and megatron-core only.

    python -m gspo_ray.bench.gpu_check                        # on a CUDA machine: SmolLM2-shaped, 1k / 4k / 16k
    python -m gspo_ray.bench.gpu_check --small                # anywhere: a 2-layer model, short rows (a dry run)

What reaches a lent GPU machine is torch, triton and small pure-Python wheels (megatron-core does; vLLM, Ray,
Transformer Engine and SmolLM2's weights do not), so the model is SmolLM2-135M's shape (llama, 30 layers, 576
hidden, 9 heads / 3 kv heads, 49,152 vocabulary, tied embeddings) built there with random weights. One printed table,
one row per check:

  1. attention by segment on the device against the same call on the CPU (values, fp32; the kernel alone: the
     whole model's log-probs are not compared across devices, Megatron's rotary tables stay where they were built);
     where Transformer Engine imports on CUDA, its fused attention in THD layout against the same call (bf16);
  2. group rows against padded rows on the device: per-token log-probs of one prompt group (fp32);
  3. one GSPO train step with group rows in bf16, with LoRA (trainer.lora), on a batch of 2 prompt groups;
  4. peak device memory of a group-row forward and backward at 1k, 4k and 16k-token completions (8 of them after a
     400-token prompt, fp32, log-probs of the completion tokens summed as the loss), and its seconds.

Before the table, what ran (so a run on a lent GPU says it): the layers built (`trainer.use_te: auto`: Transformer
Engine's spec where it imports on CUDA, else Megatron's local one, and why), the MoE experts (a small qwen3_moe
with random weights is built too: TEGroupedMLP = grouped GEMM, SequentialMLP = one GEMM per expert; its group
rows are checked against padded rows like the dense model's), the attention kernel, and which of torch's SDPA
backends accept attention by segment's calls (forward and backward, bf16 and fp32; on CUDA the backend torch picks
is the first accepting one of flash, memory-efficient, cuDNN, math).

A failing check is a row saying why, and the next one runs. Budget: <= 8 minutes on one H100.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path

SMOLLM2_SHAPE = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                     tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=32768,
                     hidden_act="silu")


MOE_SHAPE = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=256,
                 intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[], vocab_size=512, tie_word_embeddings=False,
                 rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096, hidden_act="silu")
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def write_model_dir(root: Path, small: bool) -> Path:
    """A HF directory holding only config.json (the weights are Megatron's random init)."""
    cfg = dict(SMOLLM2_SHAPE)
    if small:
        cfg.update(num_hidden_layers=2, vocab_size=512, max_position_embeddings=4096)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def group_batch(prompt: int, completions: list[int], vocab: int, seed: int = 0, groups: int = 1):
    """A TrainBatch of `groups` prompt groups: a prompt of `prompt` random tokens, completions of the given lengths."""
    import torch

    from gspo_ray.data.records import Sample, collate

    g = torch.Generator().manual_seed(seed)
    samples, advs = [], []
    for q in range(groups):
        ids = torch.randint(3, vocab, (prompt,), generator=g).tolist()
        for j, n in enumerate(completions):
            comp = torch.randint(3, vocab, (n,), generator=g).tolist()
            samples.append(Sample(prompt_uid=f"q{q}", sample_index=j, prompt_ids=ids, completion_ids=comp,
                                  logprobs=[0.0] * n, loss_mask=[1] * n, versions=[0] * n, finish_reason="stop"))
            advs.append([float(torch.randn(1, generator=g))] * n)
    return collate(samples, advs)


def save_weights(model, spec, model_dir: Path) -> None:
    """The built model's (random) weights as the HF directory's model.safetensors."""
    from safetensors.torch import save_file

    from gspo_ray.trainer.bridge import hf_state_dict_from_megatron

    state = hf_state_dict_from_megatron(model, spec)
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(model_dir / "model.safetensors"))


def check_kernel(device: str) -> dict:
    import torch

    from gspo_ray.trainer.segment_attention import Segments, attend_rows

    segs = Segments(prefix=(300, 1), completions=((200, 0, 150), (400,)))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(701, 2, h, 64, generator=g) for h in (9, 3, 3))
    cpu = attend_rows(q, k, v, segs)
    dev = attend_rows(q.to(device), k.to(device), v.to(device), segs).cpu()
    return {"check": "segment attention, device vs CPU (fp32)", "max abs diff": f"{float((dev - cpu).abs().max()):.2e}"}


def check_sdpa_backends(device: str) -> dict[str, list[str]]:
    """{dtype: the SDPA backends that run attention by segment's calls (a prefix and two completions, forward and
    backward) when torch may use that backend alone}."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from gspo_ray.trainer.segment_attention import Segments, attend_rows

    segs = Segments(prefix=(64,), completions=((32, 16),))
    accepted = {}
    for dtype in (torch.bfloat16, torch.float32):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(112, 1, h, 64, generator=g).to(device, dtype).requires_grad_() for h in (4, 2, 2))
        ok = []
        for name in SDPA_BACKENDS:
            try:
                with sdpa_kernel([getattr(SDPBackend, name)]):
                    attend_rows(q, k, v, segs).float().sum().backward()
                ok.append(name.removesuffix("_ATTENTION").lower())
            except RuntimeError:  # "No available kernel" (the backend refuses these inputs)
                pass
        accepted[str(dtype).removeprefix("torch.")] = ok
    return accepted


def kernels_line(name: str, model, use_te: bool) -> str:
    """One line: what `model` runs (model.kernel_summary), and why Transformer Engine is not used where it is not."""
    from gspo_ray.trainer.model import kernel_summary
    from gspo_ray.trainer.model_spec import te_missing

    summary = kernel_summary(model)
    why = "" if use_te else f" (transformer_engine: {te_missing() or 'off'})"
    return (f"{name}: layers {summary['layers']}{why}, MoE experts {summary['experts']}, "
            f"attention {summary['attention']}")


def check_moe(root: Path, device: str, use_te: bool, lines: list[str]) -> dict:
    """A small qwen3_moe with random weights: which experts were built (appended to `lines`), and its group rows
    against padded rows."""
    import torch

    from gspo_ray.trainer.model import build_model

    (root / "config.json").parent.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(MOE_SHAPE))
    torch.manual_seed(0)
    model, _ = build_model(str(root), load_weights=False, use_te=use_te)
    lines.append(kernels_line("MoE model", model, use_te))
    row = check_group_vs_padded(model, MOE_SHAPE["vocab_size"], device)
    return {**row, "check": row["check"].replace("group rows", "MoE group rows")}


def check_te_attention(device: str) -> dict:
    """Transformer Engine's fused attention in THD layout (te_attention.py) against attention by segment's SDPA
    calls on the same bf16 inputs, where TE imports on CUDA; otherwise a row saying why it did not run."""
    import torch

    from gspo_ray.trainer.model_spec import te_missing
    from gspo_ray.trainer.segment_attention import Segments, attend_rows
    from gspo_ray.trainer.te_attention import TEThdKernel, thd_attend_rows

    name = "TE fused attention (THD) vs SDPA (bf16)"
    if te_missing():
        return {"check": name, "error": f"not run: {te_missing()}"}
    segs = Segments(prefix=(300, 1), completions=((200, 0, 150), (400,)))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(701, 2, h, 64, generator=g).to(device, torch.bfloat16) for h in (9, 3, 3))
    got = thd_attend_rows(q, k, v, segs, TEThdKernel(9, 3, 64, 64 ** -0.5))
    want = attend_rows(q, k, v, segs).reshape(got.shape)
    return {"check": name, "max abs diff": f"{float((got.float() - want.float()).abs().max()):.2e}"}


def check_group_vs_padded(model, vocab: int, device: str) -> dict:
    import torch

    from gspo_ray.trainer.batch_layout import group_micro_batches
    from gspo_ray.trainer.logprobs import forward_group_logprobs, forward_logprobs

    batch = group_batch(64, [40, 1, 17, 80], vocab)
    (mb,) = group_micro_batches(batch, 0, 1, 8, None)
    with torch.no_grad():
        padded = forward_logprobs(model, mb.batch.tokens, mb.batch.lengths)
        grouped = forward_group_logprobs(model, mb.batch.tokens, mb.batch.lengths, mb.layout)
    diff = float((grouped - padded).abs().max())
    return {"check": "group rows vs padded rows (log-probs, fp32)", "max abs diff": f"{diff:.2e}"}


def check_train_step(model_dir: Path, vocab: int, port: int, lora: bool, small: bool) -> dict:
    import torch

    from gspo_ray.config import AlgorithmConfig, TrainerConfig
    from gspo_ray.config.lora import LoRAConfig
    from gspo_ray.trainer.worker import TrainerWorker

    extra = {"lora": LoRAConfig(rank=16, alpha=32)} if lora else {}
    tcfg = TrainerConfig(num_workers=1, dtype="bfloat16", lr=1e-5, micro_batch_size=8, shared_prefix=True, **extra)
    acfg = AlgorithmConfig()
    worker = TrainerWorker(0, 1, "127.0.0.1", port, str(model_dir), tcfg, acfg)
    try:
        batch = group_batch(40, [32, 64, 16, 48] * (1 if small else 2), vocab, groups=2)
        batch.old_logp = worker.compute_logprobs(batch)
        t0 = time.perf_counter()
        metrics = worker.train_step(batch)
        seconds = time.perf_counter() - t0
    finally:
        worker.shutdown()
    return {"check": f"GSPO step, group rows, bf16{', LoRA' if lora else ''}", "loss": metrics["train/loss"],
            "step s": seconds, "finite": bool(torch.isfinite(torch.tensor(metrics["train/loss"])))}


def check_memory(model, vocab: int, device: str, completion: int, small: bool) -> dict:
    import torch

    from gspo_ray.trainer.batch_layout import group_micro_batches
    from gspo_ray.trainer.logprobs import forward_group_logprobs

    prompt = 40 if small else 400
    batch = group_batch(prompt, [completion] * 8, vocab)
    (mb,) = group_micro_batches(batch, 0, 1, 8, None)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    logp = forward_group_logprobs(model, mb.batch.tokens, mb.batch.lengths, mb.layout,
                                  score_mask=mb.batch.loss_mask.bool())
    logp.sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    model.zero_grad(set_to_none=True)
    return {"check": f"group rows fwd+bwd, 8 x {completion} tokens after {prompt}", "tokens": mb.num_tokens,
            "peak GiB": peak, "step s": seconds}


def run(small: bool) -> list[dict]:
    import torch

    from gspo_ray.bench.common import markdown_table
    from gspo_ray.trainer.model import build_model, resolve_use_te
    from gspo_ray.trainer.parallel import destroy_distributed, free_port, init_distributed

    device = "cuda" if torch.cuda.is_available() else "cpu"
    use_te = resolve_use_te("auto")  # what trainer.use_te's default builds on this machine
    rows, lines = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "smollm2-shape", small)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]

        def attempt(fn, *args, name: str):
            try:
                rows.append(fn(*args))
            except Exception as e:  # a row that says why; the next check still runs
                traceback.print_exc()
                rows.append({"check": name, "error": f"{type(e).__name__}: {str(e)[:120]}"})

        try:
            lines.append("SDPA backends accepting attention by segment: " + "; ".join(
                f"{dtype}: {', '.join(ok) or 'none'}" for dtype, ok in check_sdpa_backends(device).items()))
        except Exception as e:  # the line says why; the checks still run
            lines.append(f"SDPA backends: {type(e).__name__}: {str(e)[:120]}")
        attempt(check_kernel, device, name="segment attention, device vs CPU")
        attempt(check_te_attention, device, name="TE fused attention (THD)")
        init_distributed(0, 1, "127.0.0.1", free_port())
        model, spec = build_model(str(model_dir), load_weights=False, use_te=use_te)
        lines.insert(0, kernels_line("SmolLM2-shaped model", model, use_te))
        save_weights(model, spec, model_dir)  # the trainer workers below load these random weights
        attempt(check_group_vs_padded, model, vocab, device, name="group rows vs padded rows")
        attempt(check_moe, Path(tmp) / "moe-shape", device, use_te, lines, name="MoE group rows vs padded rows")
        for n in ((64, 256) if small else (1000, 4000, 16000)):
            attempt(check_memory, model, vocab, device, n, small, name=f"memory at {n}")
        del model
        destroy_distributed()
        for lora in (False, True):
            attempt(check_train_step, model_dir, vocab, free_port(), lora, small, name=f"GSPO step, LoRA {lora}")
    keys = ["check", "max abs diff", "tokens", "peak GiB", "loss", "step s", "finite", "error"]
    table = markdown_table([{k: r.get(k) for k in keys} for r in rows])
    print(f"gpu-check on {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'no CUDA'}), "
          f"torch {torch.__version__}\n" + "\n".join(lines) + f"\n{table}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a 2-layer model and short rows (a dry run anywhere)")
    run(parser.parse_args(argv).small)


if __name__ == "__main__":
    main()
