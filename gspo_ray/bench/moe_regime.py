"""`gspo-ray bench --suite regime`: where does routing really move? A cheap probe over upcycled SmolLM2 MoEs.

    gspo-ray bench --suite regime            # 4 and 8 experts x router std 0.02, 0.002 x 3 lrs, ~5 min on 2 cores
    python -m gspo_ray.bench.moe_regime --experts 4,8 --top-k 2 --router-std 0.02,0.002 --lr 1e-5,1e-4,1e-3

The MoE bench's model (4 experts, top-2, router N(0, 0.02^2), lr 1e-5) moves 0.3-0.4% of top-k choices per update;
the GSPO paper reports ~10%. This probe looks for a regime in between without running a job: for each grid point
(experts E, top-k k, router std s, expert noise) the dense model is upcycled (`models/upcycle.py`, into a temporary
directory), a batch of the recipe's held-out prompts with their reference answers is forwarded once (the routing "at
sampling": every MoE layer's top-k experts per token), one policy-gradient update is taken, and the batch is
forwarded again, once per lr.
Drift = the share of (token, layer) top-k choices that changed, the quantity `moe/drift_churn_at1` measures in a job.

The update is AdamW's first step without weight decay, exact: m = g, v = g^2 after bias correction, so
delta = -lr * g / (|g| + eps), about -lr * sign(g). One gradient therefore serves every lr, and no optimizer state
is allocated. A first Adam step moves every weight by ~lr, more than a mid-training step (m / sqrt(v) < 1 once
gradients disagree across steps): this probe is an upper estimate of a job's drift after one update.
The loss is -sum_i A_i * mean_t log p(y_t) with advantages +1 / -1 alternating over the sequences (a GRPO-like
gradient: some answers pushed up, some down).
"""
from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from gspo_ray.bench.common import SMOLLM2_RECIPE, markdown_table


def record_topk(model) -> tuple[list, Callable[[], None]]:
    """Forward hooks on every Mixtral router: each forward appends the [tokens, k] expert indices per layer.
    (trainer/routing/churn.py counts the same changes on Megatron's boolean routing maps, inside a trainer.)"""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    seen: list[torch.Tensor] = []
    handles = [m.register_forward_hook(lambda _m, _i, out: seen.append(out[2].detach().clone()))
               for m in model.modules() if isinstance(m, MixtralTopKRouter)]
    return seen, lambda: [h.remove() for h in handles]


def topk_churn(before: torch.Tensor, after: torch.Tensor, keep: torch.Tensor) -> float:
    """Share of top-k choices that changed: 1 - |set before & set after| / k, averaged over the `keep` tokens.
    before, after: [tokens, k] expert indices; keep: [tokens] bool."""
    k = before.shape[-1]
    same = (before[:, :, None] == after[:, None, :]).any(-1).sum(-1).float()  # [tokens]: experts in both sets
    return float((1 - same / k)[keep].mean())


def sequence_batch(model_dir: Path, recipe: Path = SMOLLM2_RECIPE, n: int = 16):
    """n held-out prompts of the recipe with their reference answers and EOS: (ids [n, L], loss mask, valid mask)."""
    from gspo_ray.config import load_config
    from gspo_ray.data.prompts import PromptSource

    cfg = load_config(recipe, [f"model.path={model_dir}", "model.packaged=null", f"data.num_eval={n}"])
    source = PromptSource.from_config(cfg.data, str(model_dir), split="eval", max_new_tokens=16, max_model_len=256)
    tok = source.tokenizer
    rows = [(p.prompt_ids, tok.encode(str(p.reference), add_special_tokens=False) + [tok.eos_token_id])
            for p in source.prompts()[:n]]
    width = max(len(a) + len(b) for a, b in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    loss = torch.zeros(len(rows), width, dtype=torch.bool)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (prompt, answer) in enumerate(rows):
        ids[i, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        loss[i, len(prompt):len(prompt) + len(answer)] = True
        valid[i, :len(prompt) + len(answer)] = True
    return ids, loss, valid


def moe_model(dense_dir: Path, out: Path, experts: int, top_k: int, router_std: float, noise: float, seed: int = 0):
    """The upcycled Mixtral, written to `out` by `upcycle` and loaded by transformers (which fuses the experts
    in memory, so it takes the checkpoint's per-expert names only from files)."""
    from transformers import AutoModelForCausalLM

    from gspo_ray.models.upcycle import upcycle

    upcycle(dense_dir, out, experts, top_k, noise=noise, router_std=router_std, seed=seed)
    return AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()


def probe_point(model, ids, loss_mask, valid, lrs: list[float]) -> dict[float, tuple[float, float]]:
    """{lr: (drift over all MoE layers, the worst layer's)} after one first-step AdamW update at lr."""
    seen, unhook = record_topk(model)
    try:
        model.zero_grad(set_to_none=True)
        logp = torch.log_softmax(model(ids, attention_mask=valid.long()).logits[:, :-1].float(), -1)
        tok_logp = logp.gather(-1, ids[:, 1:, None])[..., 0]
        mask = loss_mask[:, 1:].float()
        adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(ids.shape[0])])
        (-(adv * (tok_logp * mask).sum(1) / mask.sum(1)).sum()).backward()
        before, seen[:] = list(seen), []
        params = [p for p in model.parameters() if p.grad is not None]
        for p in params:  # AdamW's first step per unit lr, in place of the gradient (no second copy)
            p.grad.div_(p.grad.abs() + 1e-8)
        step = [p.grad for p in params]
        keep = valid.reshape(-1)
        out = {}
        for lr in lrs:
            with torch.no_grad():
                for p, s in zip(params, step):
                    p.sub_(lr * s)
                model(ids, attention_mask=valid.long())
                for p, s in zip(params, step):
                    p.add_(lr * s)  # back to the sampling weights (to float rounding) for the next lr
            per_layer = [topk_churn(b, a, keep) for b, a in zip(before, seen)]
            seen[:] = []
            out[lr] = (sum(per_layer) / len(per_layer), max(per_layer))
        return out
    finally:
        unhook()


def run_regime_probe(model_dir: Path, experts=(4, 8), top_ks=(2,), router_stds=(0.02, 0.002), noises=(0.01,),
                     lrs=(1e-5, 1e-4, 1e-3), n: int = 16) -> list[dict]:
    """One row per (grid point, lr); each point's rows print as soon as it is measured."""
    ids, loss_mask, valid = sequence_batch(model_dir, n=n)
    rows = []
    for e, k, s, noise in itertools.product(experts, top_ks, router_stds, noises):
        if not 2 <= k <= e:
            continue
        t = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="regime-") as tmp:
            drift = probe_point(moe_model(model_dir, Path(tmp) / "moe", e, k, s, noise), ids, loss_mask, valid,
                                list(lrs))
        for lr, (mean, worst) in drift.items():
            rows.append({"experts": e, "top-k": k, "router std": s, "expert noise": noise, "lr": f"{lr:g}",
                         "drift after 1 update": round(mean, 4), "worst layer": round(worst, 4),
                         "point s": round(time.perf_counter() - t)})
        print(markdown_table(rows[-len(lrs):]), flush=True)
    return rows


def main(argv=None) -> None:
    from gspo_ray.models.gguf import ensure_imported

    floats = lambda s: tuple(float(x) for x in s.split(","))  # noqa: E731
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=ints, default=(4, 8))
    ap.add_argument("--top-k", type=ints, default=(2,))
    ap.add_argument("--router-std", type=floats, default=(0.02, 0.002))
    ap.add_argument("--noise", type=floats, default=(0.01,))
    ap.add_argument("--lr", type=floats, default=(1e-5, 1e-4, 1e-3))
    args = ap.parse_args(argv)
    rows = run_regime_probe(ensure_imported(Path("runs/models/smollm2-135m-instruct")), args.experts, args.top_k,
                            args.router_std, args.noise, args.lr)
    print(markdown_table(rows))

if __name__ == "__main__":
    main()
