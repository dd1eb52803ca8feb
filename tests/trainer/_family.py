"""Shared pieces of the model-family tests (tests/trainer/test_family_*.py): what their spawned scenarios run on a
rank, and the comparisons the test process makes on what comes back.

    out |= layout_logprobs(rank, world, rdzv, model_dir, tokens, lengths, push_key="pushed")  # {"tp2_sp", "ep2", ..}
    out |= row_layout_steps(rank, world, ports, model_dir, batch)                            # {"off", "on", "packed"}
    assert_rows_equal_padded(r["off"], r["on"], rank, logp_tol=..., metric_tol=..., grad_tol=..., keys=(...))

Scenario code here runs on spawned ranks (tests/trainer/_spawn.py); like the test modules it is imported by name.
"""
from __future__ import annotations

import pytest
import torch

from _spawn import algo_cfg, trainer_cfg

VOCAB = 22  # the tiny models' vocabulary (models/tiny.py's alphabet)


# ---- on a rank -----------------------------------------------------------------------------------------------------
def logprobs(model, tokens, lengths):
    """The trainer's log-probs [B, L] of `tokens` without grad (forward_logprobs; its first output if a tuple)."""
    from gspo_ray.trainer.logprobs import forward_logprobs

    with torch.no_grad():
        logp = forward_logprobs(model, tokens, lengths)
    return (logp[0] if isinstance(logp, tuple) else logp).detach()


LAYOUTS = (("tp2_sp", 2, 1), ("ep2", 1, 2))  # (name, tp, ep)


def layout_logprobs(rank, world, rdzv, model_dir, tokens, lengths, layouts=LAYOUTS, push_key=None,
                    split_ep_rows=True) -> dict:
    """Both ranks build `model_dir` at each layout in turn and compute its log-probs: at TP > 1 of every row, at TP 1
    (EP) of rows rank, rank + world, ... (`split_ep_rows`; else of every row). `push_key`: also the HF state dict
    gathered back (what a push sends; collective) under f"{layout}_{push_key}"."""
    from megatron.core import parallel_state

    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed
    from gspo_ray.trainer.weights.bridge import hf_state_dict_from_megatron

    out = {}
    for layout, tp, ep in layouts:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        init_distributed(rank, world, "", 0, tp=tp, ep=ep, init_method=f"file://{rdzv}/pair")
        model, spec = build_model(model_dir)
        rows = slice(rank, None, world) if tp == 1 and split_ep_rows else slice(None)
        out[layout] = logprobs(model, tokens[rows], lengths[rows])
        if push_key:
            out[f"{layout}_{push_key}"] = hf_state_dict_from_megatron(model, spec)
    destroy_distributed()
    return out


def worker_step(rank, world, port, model_dir, batch, tcfg, save=None, fresh_old_logp=False) -> dict:
    """One TrainerWorker step on `batch`: {"logp" before it, "metrics", "grads" (whole main_grads)}. old_logp is the
    sampling policy, the worker's own log-probs nudged per row so some ratios leave the clip band, set when the batch
    has none (or always: `fresh_old_logp`). `save`: also the trained weights as a push sends them ("pushed") and a
    checkpoint there."""
    from gspo_ray.trainer.weights.bridge import hf_state_dict_from_megatron
    from gspo_ray.trainer.worker import TrainerWorker

    w = TrainerWorker(rank, world, "127.0.0.1", port, model_dir, tcfg, algo_cfg())
    logp = w.compute_logprobs(batch)
    if fresh_old_logp or not batch.old_logp.any():
        shift = 1e-3 * (torch.arange(batch.num_sequences)[:, None] % 3)
        batch.old_logp = torch.where(batch.loss_mask.bool(), logp - shift, 0.0)
    metrics = w.train_step(batch)
    out = {"logp": logp, "metrics": metrics,
           "grads": {n: p.main_grad.detach().clone() for n, p in w.gpt.named_parameters()}}
    if save is not None:
        out["pushed"] = hf_state_dict_from_megatron(w.gpt, w.spec)
        w.save(save)
    w.shutdown()
    return out


ROW_LAYOUTS = (("off", False, False), ("on", True, True), ("packed", False, True))  # (run, group rows, packed rows)


def row_layout_steps(rank, world, ports, model_dir, batch, save=None, fresh_old_logp=False) -> dict:
    """One step at TP 2 + SP (the plain optimizer: whole main_grads) on padded rows ("off", on ports[0]; saved to
    `save` if given), group rows ("on") and packed rows ("packed")."""
    out = {}
    for i, (run, shared, packed) in enumerate(ROW_LAYOUTS):
        tcfg = trainer_cfg(world, tp=2, micro_batch_size=6, grad_clip=0.0, lr=1e-3, shared_prefix=shared,
                           packed_rows=packed, use_distributed_optimizer=False)
        out[run] = worker_step(rank, world, ports[i], model_dir, batch, tcfg, save=save if run == "off" else None,
                               fresh_old_logp=fresh_old_logp)
    return out


def resume_logprobs(port, model_dir, ckpt, batch):
    """Rank 0 alone (a world of its own, EP 1): the log-probs of `batch` under checkpoint `ckpt` resumed."""
    from gspo_ray.trainer.worker import TrainerWorker

    w = TrainerWorker(0, 1, "127.0.0.1", port, model_dir, trainer_cfg(1, lr=0.0), algo_cfg())
    w.load(ckpt)
    logp = w.compute_logprobs(batch)
    w.shutdown()
    return logp


def router_selection_check(model, tokens, lengths, score=lambda logits: logits) -> list:
    """Per MoE layer: (tokens where routing.selection's top-k differs from the routing map Megatron's router used,
    tokens where the plain top-k of score(logits) -- without the router's bias -- does, tokens)."""
    from gspo_ray.trainer.logprobs import forward_logprobs
    from gspo_ray.trainer.routing.churn import find_routers
    from gspo_ray.trainer.routing.selection import router_topk

    seen = []

    def hook(module, args, output):
        x, used = args[0], output[1].reshape(-1, output[1].shape[-1])
        as_map = lambda idx: torch.zeros_like(used).scatter(1, idx.reshape(-1, module.topk), True)  # noqa: E731
        logits = torch.nn.functional.linear(x.float(), module.weight.float())
        unbiased = torch.topk(score(logits), module.topk, dim=-1).indices
        seen.append((int((as_map(router_topk(module, x)) != used).any(-1).sum()),
                     int((as_map(unbiased) != used).any(-1).sum()), used.shape[0]))

    handles = [r.register_forward_hook(hook) for _, r in find_routers(model)]
    with torch.no_grad():
        forward_logprobs(model, tokens, lengths)
    for h in handles:
        h.remove()
    return seen


# ---- in the test process ---------------------------------------------------------------------------------------------
def maxdiff(a, b) -> float:
    return float((a - b).abs().max())


def prompt_groups(seed: int = 3, vocab: int = VOCAB):
    """A TrainBatch of prompt groups of 4, 2 and 2 completions (each group one prompt: group rows share it), prompts
    of 3-6 tokens, completions of 1-7, one completion fully masked; old log-probs are set by the trainer's policy
    (nudged per row so some ratios leave the clip band) on the ranks."""
    from gspo_ray.data.records import Sample, collate

    g = torch.Generator().manual_seed(seed)
    samples, advs = [], []
    for q, size in enumerate((4, 2, 2)):
        prompt = torch.randint(3, vocab, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        for j in range(size):
            comp = torch.randint(3, vocab, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
            mask = [0 if (q, j) == (0, 1) else 1] * len(comp)
            samples.append(Sample(prompt_uid=f"q{q}", sample_index=j, prompt_ids=prompt, completion_ids=comp,
                                  logprobs=[0.0] * len(comp), loss_mask=mask, versions=[0] * len(comp),
                                  finish_reason="stop"))
            advs.append([float(torch.randn(1, generator=g))] * len(comp))
    return collate(samples, advs)


def checkpoint_tensors(model_dir, mtp: bool = True) -> dict:
    """The checkpoint's tensors (every *.safetensors file); mtp=False: only those the trainer's model holds (not the
    ones its family ignores by design: the multi-token-prediction layers)."""
    from pathlib import Path

    from safetensors.torch import load_file

    from gspo_ray.trainer.families import family_of
    from gspo_ray.trainer.model_spec import read_hf_config

    cfg, tensors = read_hf_config(model_dir), {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors |= load_file(str(f))
    family = family_of(cfg["model_type"])
    return {n: t for n, t in tensors.items() if mtp or not family.ignored_hf_tensor(cfg, n)}


def assert_rows_equal_padded(off: dict, on: dict, rank: int, logp_tol: float, metric_tol: float, grad_tol: float,
                             keys=("train/loss",), fewer_forward_tokens=True, grads_nonzero=True) -> None:
    """Group or packed rows (`on`) against padded rows (`off`), one rank's worker_step results: log-probs within
    logp_tol, the metrics `keys` within metric_tol relative, every gradient within grad_tol relative to its largest
    entry (and, `grads_nonzero`, none all zero but an idle expert's); `fewer_forward_tokens`: the rows forwarded
    fewer tokens."""
    assert maxdiff(on["logp"], off["logp"]) <= logp_tol, (rank, "logp")
    for key in keys:
        assert on["metrics"][key] == pytest.approx(off["metrics"][key], rel=metric_tol, abs=1e-9), (rank, key)
    if fewer_forward_tokens:
        assert on["metrics"]["train/forward_tokens"] < off["metrics"]["train/forward_tokens"]
    assert set(on["grads"]) == set(off["grads"])
    for name, g in off["grads"].items():
        if grads_nonzero:
            assert g.abs().max() > 0 or "local_experts" in name, name
        rel = maxdiff(on["grads"][name], g) / float(g.abs().max().clamp(min=1e-12))
        assert rel <= grad_tol, (rank, name, rel)
