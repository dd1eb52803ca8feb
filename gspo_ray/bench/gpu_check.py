"""`make gpu-check` (scripts/gpu_check.sh): the trainer on one lent GPU, with torch and megatron-core only.

    python -m gspo_ray.bench.gpu_check                        # on a CUDA machine: SmolLM2-shaped, 1k / 4k / 16k
    python -m gspo_ray.bench.gpu_check --small                # anywhere: a 2-layer 128-wide model, short rows

What reaches a lent GPU machine is its image (Python 3.12, torch with CUDA, numpy, packaging, pyyaml, safetensors,
transformers) and wheels that travel with the run (megatron-core; vLLM, Ray, Transformer Engine, pydantic and
SmolLM2's weights do not), so this module and everything it imports before a row runs use the standard library,
torch and megatron-core alone (tests/bench/test_gpu_check.py runs it under an import hook that refuses anything
else). The model is SmolLM2-135M's shape (llama, 30 layers, 576 hidden, 9 heads / 3 kv heads, 49,152 vocabulary,
tied embeddings) built there with random weights. Without CUDA it refuses to run unless --small. One table, one
row per check, each row printed (and flushed) as it finishes, so a crash or a timeout keeps the rows before it:

  1. attention by segment on the device against the same call on the CPU (values, fp32; the kernel alone: the
     whole model's log-probs are not compared across devices, Megatron's rotary tables stay where they were built);
     where Transformer Engine imports on CUDA, its fused attention in THD layout against the same call (bf16);
  2. group rows against padded rows on the device: per-token log-probs of one prompt group (fp32), dense and MoE;
  3. where Transformer Engine imports on CUDA: the trainer's `te_thd` attention (trainer.attention_kernel) on
     packed rows (trainer.packed_rows: several group rows, or several samples, one after another in one row)
     against padded rows of the same model (bf16); elsewhere the row says it was skipped and why;
  4. peak device memory of a group-row forward and backward at 1k, 4k and 16k-token completions (8 of them after a
     400-token prompt, fp32, log-probs of the completion tokens summed as the loss), and its seconds;
  5. one GSPO step with group rows in bf16 from the trainer's parts (the model, the GSPO loss, Megatron's DDP and
     mixed-precision optimizer; no trainer worker, which takes the pydantic job config);
  6. the same through the trainer worker (trainer/worker.py), without and with LoRA: only where pydantic and
     safetensors import (the row says so otherwise; docs/scale.md says which wheels add them).

Before the table, what ran (so a run on a lent GPU says it): the layers built (`trainer.use_te: auto`: Transformer
Engine's spec where it imports on CUDA, else Megatron's local one, and why), the MoE experts (a small qwen3_moe
with random weights is built too: TEGroupedMLP = grouped GEMM, SequentialMLP = one GEMM per expert), the attention
kernel, and which of torch's SDPA backends accept attention by segment's calls (forward and backward, bf16 and
fp32; on CUDA the backend torch picks is the first accepting one of flash, memory-efficient, cuDNN, math).

A failing check is a row saying why, and the next one runs. Budget: <= 8 minutes on one H100.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
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
COLUMNS = ("check", "max abs diff", "tokens", "peak GiB", "loss", "step s", "finite", "error")
# the trainer worker's rows need these beyond torch and megatron-core (its pydantic config, its safetensors loader)
WORKER_MODULES = ("pydantic", "safetensors")


@dataclass(frozen=True)
class StepSettings:
    """The optimizer settings trainer/optim.py reads from a TrainerConfig, for the step built from the trainer's
    parts without pydantic (TrainerConfig's defaults, lr as the SmolLM2 recipes set it)."""

    dtype: str = "bfloat16"
    lr: float = 1e-5
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    distributed_optimizer: bool = False
    lr_warmup_steps: int = 0
    lr_schedule: str = "constant"
    total_steps: int | None = None


def table_line(cells) -> str:
    """One Markdown table line: floats to 3 decimals, None as "-"."""
    return "| " + " | ".join("-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
                             for v in cells) + " |"


def print_row(row: dict) -> None:
    """A finished check's row of the table, flushed at once (a later crash or timeout keeps it)."""
    print(table_line(row.get(k) for k in COLUMNS), flush=True)


def missing_module(names) -> str | None:
    """The first of `names` that does not import here, as a sentence; None when all do."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            return f"{name} not importable"
    return None


def write_model_dir(root: Path, small: bool) -> Path:
    """A HF directory holding only config.json (the weights are Megatron's random init)."""
    cfg = dict(SMOLLM2_SHAPE)
    if small:  # a dry run's model: SmolLM2's layer kinds and GQA, a fraction of its width
        cfg.update(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096)
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
    """The built model's (random) weights as the HF directory's model.safetensors (the worker rows load them)."""
    from safetensors.torch import save_file

    from gspo_ray.trainer.weights.bridge import hf_state_dict_from_megatron

    state = hf_state_dict_from_megatron(model, spec)
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(model_dir / "model.safetensors"))


def check_kernel(device: str) -> dict:
    import torch

    from gspo_ray.trainer.attention.segment_attention import Segments, attend_rows

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

    from gspo_ray.trainer.attention.segment_attention import Segments, attend_rows

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


def build_moe(root: Path, use_te: bool):
    """A small qwen3_moe with random weights (which experts it gets is printed before the table)."""
    import torch

    from gspo_ray.trainer.model import build_model

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(MOE_SHAPE))
    torch.manual_seed(0)
    model, _ = build_model(str(root), load_weights=False, use_te=use_te)
    return model


def check_te_attention(device: str) -> dict:
    """Transformer Engine's fused attention in THD layout (te_attention.py) against attention by segment's SDPA
    calls on the same bf16 inputs, where TE imports on CUDA; otherwise a row saying why it did not run."""
    import torch

    from gspo_ray.trainer.model_spec import te_missing
    from gspo_ray.trainer.attention.segment_attention import Segments, attend_rows
    from gspo_ray.trainer.attention.te_attention import TEThdKernel, thd_attend_rows

    name = "TE fused attention (THD) vs SDPA (bf16)"
    if te_missing():
        return {"check": name, "error": f"skipped: {te_missing()}"}
    segs = Segments(prefix=(300, 1), completions=((200, 0, 150), (400,)))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(701, 2, h, 64, generator=g).to(device, torch.bfloat16) for h in (9, 3, 3))
    got = thd_attend_rows(q, k, v, segs, TEThdKernel(9, 3, 64, 64 ** -0.5))
    want = attend_rows(q, k, v, segs).reshape(got.shape)
    return {"check": name, "max abs diff": f"{float((got.float() - want.float()).abs().max()):.2e}"}


def layout_vs_padded(model, mbs) -> float:
    """Largest |log-prob| difference between each micro-batch's layout (group rows, packed rows) and its padded
    rows, forwarded by the same model."""
    import torch

    from gspo_ray.trainer.logprobs import forward_group_logprobs, forward_logprobs

    diff = 0.0
    with torch.no_grad():
        for mb in mbs:
            padded = forward_logprobs(model, mb.batch.tokens, mb.batch.lengths)
            laid = forward_group_logprobs(model, mb.batch.tokens, mb.batch.lengths, mb.layout)
            diff = max(diff, float((laid - padded).abs().max()))
    return diff


def check_group_vs_padded(model, vocab: int, name: str = "group rows") -> dict:
    from gspo_ray.trainer.batch_layout import group_micro_batches

    mbs = group_micro_batches(group_batch(64, [40, 1, 17, 80], vocab), 0, 1, 8, None)
    return {"check": f"{name} vs padded rows (log-probs, fp32)", "max abs diff": f"{layout_vs_padded(model, mbs):.2e}"}


def check_te_thd_packed(model_dir: Path, vocab: int, packed: str) -> dict:
    """The trainer's te_thd attention (build_model(attention="te_thd"), SegmentAttention -> thd_attend_rows) on one
    packed row of several units (packed="group rows": two prompt groups' group rows; "samples": eight samples)
    against padded rows of the same bf16 model. Every unit after the first must match as well as the first: a
    kernel that attends only a row's first unit shows here as a large difference."""
    import torch

    from gspo_ray.trainer.batch_layout import group_micro_batches, row_micro_batches
    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.model_spec import te_missing

    name = f"te_thd packed {packed} vs padded rows (bf16)"
    if te_missing():
        return {"check": name, "error": f"skipped: {te_missing()}"}
    torch.manual_seed(0)
    model, _ = build_model(str(model_dir), dtype=torch.bfloat16, load_weights=False, use_te=True,
                           attention="te_thd")
    batch = group_batch(48, [40, 1, 17, 80], vocab, groups=2)
    if packed == "group rows":
        mbs = group_micro_batches(batch, 0, 1, 8, None, packed=True)
    else:
        mbs = row_micro_batches(batch, 0, 1, 8, None, packed=True)
    return {"check": name, "max abs diff": f"{layout_vs_padded(model, mbs):.2e}",
            "tokens": sum(mb.num_tokens for mb in mbs)}


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


def check_part_step(model_dir: Path, vocab: int, use_te: bool, small: bool) -> dict:
    """One GSPO step in bf16 on group rows, from the trainer's parts: the model, old log-probs, the sequence-level
    loss (GSPO's clip band 3e-4 / 4e-4), Megatron's DDP and bf16 optimizer (fp32 main weights), the step."""
    import torch

    from gspo_ray.algo import compute_policy_loss
    from gspo_ray.trainer.batch_layout import group_micro_batches
    from gspo_ray.trainer.logprobs import forward_group_logprobs
    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.optim import build_ddp, build_optimizer, build_scheduler, optimizer_step, zero_grads

    settings = StepSettings()
    torch.manual_seed(0)
    model, _ = build_model(str(model_dir), dtype=torch.bfloat16, load_weights=False, use_te=use_te)
    ddp = build_ddp(model, dtype=settings.dtype)
    optimizer = build_optimizer(ddp, settings)
    scheduler = build_scheduler(optimizer, settings)
    batch = group_batch(40, [32, 64, 16, 48] * (1 if small else 2), vocab, groups=2)
    mbs = group_micro_batches(batch, 0, 1, 8, None)
    t0 = time.perf_counter()
    zero_grads(ddp, optimizer)
    losses = []
    for mb in mbs:
        rows = mb.batch
        mask = rows.loss_mask.bool()
        with torch.no_grad():
            old = forward_group_logprobs(model, rows.tokens, rows.lengths, mb.layout, score_mask=mask).float()
        logp = forward_group_logprobs(model, rows.tokens, rows.lengths, mb.layout, score_mask=mask).float()
        loss, _ = compute_policy_loss(logp, old, rows.adv.to(logp), mask.to(logp.device), "sequence", 3e-4, 4e-4)
        (loss / len(mbs)).backward()
        losses.append(float(loss.detach()))
    grad_norm, _, ok = optimizer_step(ddp, optimizer, scheduler)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    loss = sum(losses) / len(losses)
    del ddp, optimizer, model
    return {"check": "GSPO step, group rows, bf16 (trainer parts)", "loss": loss, "step s": seconds,
            "finite": ok and torch.isfinite(torch.tensor([loss, grad_norm])).all().item()}


def check_worker_step(model_dir: Path, vocab: int, port: int, lora: bool, small: bool) -> dict:
    """One GSPO step through the trainer worker, bf16, group rows, with or without LoRA (needs WORKER_MODULES)."""
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
    return {"loss": metrics["train/loss"], "step s": seconds,
            "finite": bool(torch.isfinite(torch.tensor(metrics["train/loss"])))}


def run(small: bool) -> list[dict]:
    """Every check, printing the lines and each row as they finish; returns the rows."""
    import torch
    from megatron.core import __version__ as megatron_version

    from gspo_ray.trainer.model import build_model, resolve_use_te
    from gspo_ray.trainer.parallel import destroy_distributed, free_port, init_distributed

    device = "cuda" if torch.cuda.is_available() else "cpu"
    use_te = resolve_use_te("auto")  # what trainer.use_te's default builds on this machine
    print(f"gpu-check on {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'no CUDA'}), torch "
          f"{torch.__version__}, megatron-core {megatron_version}, Python {sys.version.split()[0]}", flush=True)
    rows = []

    def attempt(fn, *args, name: str) -> None:
        try:
            row = fn(*args)
        except Exception as e:  # a row that says why; the next check still runs
            traceback.print_exc()
            row = {"check": name, "error": f"{type(e).__name__}: {str(e)[:120]}"}
        rows.append(row)
        print_row(row)

    def line(fn, what: str) -> None:
        try:
            print(fn(), flush=True)
        except Exception as e:  # the line says why; the checks still run
            print(f"{what}: {type(e).__name__}: {str(e)[:120]}", flush=True)

    line(lambda: "SDPA backends accepting attention by segment: " + "; ".join(
        f"{dtype}: {', '.join(ok) or 'none'}" for dtype, ok in check_sdpa_backends(device).items()), "SDPA backends")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "smollm2-shape", small)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        init_distributed(0, 1, "127.0.0.1", free_port())
        model, spec = build_model(str(model_dir), load_weights=False, use_te=use_te)
        print(kernels_line("SmolLM2-shaped model", model, use_te), flush=True)
        moe = None
        try:
            moe = build_moe(Path(tmp) / "moe-shape", use_te)
            print(kernels_line("MoE model", moe, use_te), flush=True)
        except Exception as e:  # the MoE row below says so too
            traceback.print_exc()
            print(f"MoE model: {type(e).__name__}: {str(e)[:120]}", flush=True)
        print(table_line(COLUMNS) + "\n|" + "---|" * len(COLUMNS), flush=True)
        attempt(check_kernel, device, name="segment attention, device vs CPU")
        attempt(check_te_attention, device, name="TE fused attention (THD)")
        attempt(check_group_vs_padded, model, vocab, name="group rows vs padded rows")
        if moe is not None:
            attempt(check_group_vs_padded, moe, MOE_SHAPE["vocab_size"], "MoE group rows",
                    name="MoE group rows vs padded rows")
        del moe
        for packed in ("group rows", "samples"):
            attempt(check_te_thd_packed, model_dir, vocab, packed, name=f"te_thd packed {packed}")
        for n in ((32,) if small else (1000, 4000, 16000)):
            attempt(check_memory, model, vocab, device, n, small, name=f"memory at {n}")
        attempt(check_part_step, model_dir, vocab, use_te, small, name="GSPO step, group rows, bf16 (trainer parts)")
        worker_missing = missing_module(WORKER_MODULES)
        if worker_missing is None:
            save_weights(model, spec, model_dir)  # the trainer workers below load these random weights
        del model
        destroy_distributed()
        for lora in (False, True):
            name = f"GSPO step, group rows, bf16, trainer worker{', LoRA' if lora else ''}"
            if worker_missing:
                attempt(lambda n=name: {"check": n, "error": f"skipped: {worker_missing}"}, name=name)
            else:
                attempt(lambda *a, n=name: {"check": n, **check_worker_step(*a)}, model_dir, vocab, free_port(),
                        lora, small, name=name)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a 2-layer model and short rows (a dry run anywhere)")
    small = parser.parse_args(argv).small
    import torch

    if not small and not torch.cuda.is_available():  # the full-size rows on a CPU would only run into the timeout
        print(f"gpu_check: torch {torch.__version__} sees no CUDA device; the full-size check needs one "
              "(--small: a 2-layer dry run anywhere)", file=sys.stderr)
        sys.exit(2)
    run(small)


if __name__ == "__main__":
    main()
