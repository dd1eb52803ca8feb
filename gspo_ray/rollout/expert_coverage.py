"""Which experts of a live vLLM MoE model a forward pass reached: per-layer router counts, for the weight-push probe.

    with RouterCounter(model, top_k=8) as counter:        # model: the engine's nn.Module (in-process engine)
        engine.prompt_logprobs(...)                        # any forwards
    counter.counts        # {"model.layers.0.mlp": tensor([tokens routed to expert 0, 1, ...]), ...}
    coverage_report(counter.counts)                        # {"sync/probe_expert_coverage": 1.0, ...}, missed

A probe only checks the experts its tokens are routed to: a corrupt expert that no probe token reaches passes
the check. The counter hooks each MoE block's router (`gate`, a module beside `experts`) and takes the top-k of
its logits: exactly the experts chosen by softmax/sigmoid top-k routers (Qwen-MoE, Mixtral). Routers that add a
score-correction bias or group limits (DeepSeek-V3) are approximated.
"""
from __future__ import annotations

import torch

Counts = dict[str, torch.Tensor]


def moe_routers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{MoE block name: its router module}: every module holding both `gate` and `experts`."""
    return {name: m.gate for name, m in model.named_modules()
            if isinstance(getattr(m, "gate", None), torch.nn.Module) and hasattr(m, "experts")}


class RouterCounter:
    """Context manager: while active, counts the tokens each MoE block routes to each of its experts."""

    def __init__(self, model: torch.nn.Module, top_k: int):
        self.routers = moe_routers(model)
        self.top_k = top_k
        self.counts: Counts = {}
        self._handles: list = []

    def _hook(self, name: str):
        def record(module, inputs, output):
            logits = output[0] if isinstance(output, tuple) else output  # vLLM linears return (out, bias)
            chosen = logits.detach().float().topk(min(self.top_k, logits.shape[-1]), dim=-1).indices
            counts = torch.bincount(chosen.reshape(-1).cpu(), minlength=logits.shape[-1])
            self.counts[name] = counts if name not in self.counts else self.counts[name] + counts
        return record

    def __enter__(self) -> "RouterCounter":
        self._handles = [r.register_forward_hook(self._hook(name)) for name, r in self.routers.items()]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def coverage_report(counts: Counts) -> tuple[dict[str, float], list[tuple[str, int]]]:
    """(metrics, missed): the share of (layer, expert) pairs that got >= 1 token, the fewest tokens any expert got,
    and the (layer, expert) pairs that got none. No MoE layer: no metrics, nothing missed."""
    if not counts:
        return {}, []
    missed = [(name, int(e)) for name, c in counts.items() for e in torch.nonzero(c == 0).flatten().tolist()]
    total = sum(c.numel() for c in counts.values())
    return ({"sync/probe_expert_coverage": 1.0 - len(missed) / total,
             "sync/probe_min_expert_tokens": float(min(int(c.min()) for c in counts.values()))}, missed)
