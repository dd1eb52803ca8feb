"""Router churn: how many top-k expert choices one optimizer step changes, per MoE layer.

    recorder = RouterRecorder(model)                 # forward hooks on every megatron TopKRouter
    with recorder.capture(lengths):                  # before the step: the training forward of a micro-batch
        logp = forward_logprobs(model, tokens, lengths)
    ...  optimizer step  ...
    with torch.no_grad(), recorder.capture(lengths, phase="after"):
        forward_logprobs(model, tokens, lengths)     # same tokens, new weights
    metrics = recorder.churn_metrics(group)          # {"moe/router_churn_l0": ..., "moe/router_churn": ...,
                                                     #  "moe/expert_load_max_over_mean[_l0]": ...}

For each real token (position < its row's length) and layer, with E_before / E_after its top-k expert sets:
`churn = sum_tokens |E_before \\ E_after| / (k * #tokens)`. 0 = identical routing, 1 = all choices moved. Counts are
summed over all ranks (each sees different rows under DP, a different token shard under sequence parallelism).

Expert load, from the same capture (the forwards before the step): per layer, the tokens the busiest expert got
over the mean expert's (`moe/expert_load_max_over_mean_l{i}`, and its mean over layers): how far from balanced
the routing is, which a frozen load-balancing bias (GLM-4.5, DeepSeek-V3: docs/moe.md) no longer corrects.

The routing map that TopKRouter returns (`output[1]`, bool [tokens, experts]) is laid out sequence-major
(`row = s * B + b`) over this rank's sequence shard; the shard offset under sequence parallelism is
`tp_rank * S_local`.
"""
from __future__ import annotations

import contextlib
import re
from collections import defaultdict

import torch
import torch.distributed as dist
from gspo_ray.compat.megatron_import import megatron_core  # noqa: F401  (first: megatron without torch.compile)
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter

from gspo_ray.trainer.recompute import in_recompute
from gspo_ray.trainer.weights.stage_names import layer_offset

_LAYER_RE = re.compile(r"layers\.(\d+)\.")


def find_routers(model: torch.nn.Module) -> list[tuple[int, TopKRouter]]:
    """(global layer index, router) for every TopKRouter under `model`, in layer order (a pipeline stage's layers
    numbered as at PP 1: weights/stage_names.py)."""
    found, offset = [], layer_offset(model)
    for name, module in model.named_modules():
        if isinstance(module, TopKRouter):
            m = _LAYER_RE.search(name)
            if m is None:
                raise ValueError(f"cannot tell the layer of router {name!r}")
            found.append((int(m.group(1)) + offset, module))
    return sorted(found, key=lambda x: x[0])


def token_valid_mask(lengths: torch.Tensor, s_local: int, batch: int, seq_offset: int) -> torch.Tensor:
    """Bool [s_local * batch], sequence-major: True where position seq_offset + s < lengths[b]."""
    pos = torch.arange(seq_offset, seq_offset + s_local)[:, None]  # [S, 1]
    return (pos < lengths.to(pos.device)[None, :batch]).reshape(-1)


class RouterRecorder:
    """Captures top-k routing maps of every MoE layer during chosen forwards (one list per phase and layer)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = find_routers(model)
        self.topk = self.routers[0][1].topk if self.routers else 0
        self._phase: str | None = None
        self._lengths: torch.Tensor | None = None
        self.maps: dict[str, dict[int, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        self._handles = [r.register_forward_hook(self._hook(layer)) for layer, r in self.routers]

    def _hook(self, layer: int):
        def hook(module, args, output):
            if self._phase is None or in_recompute():
                return
            hidden = args[0]  # [S_local, B, H]
            s_local, batch = int(hidden.shape[0]), int(hidden.shape[1])
            sp = module.config.sequence_parallel
            offset = parallel_state.get_tensor_model_parallel_rank() * s_local if sp else 0
            valid = token_valid_mask(self._lengths, s_local, batch, offset)
            routing_map = output[1].detach()
            self.maps[self._phase][layer].append(routing_map[valid.to(routing_map.device)].to("cpu", torch.bool))
        return hook

    @contextlib.contextmanager
    def capture(self, lengths: torch.Tensor, phase: str = "before"):
        """Record routing maps of the forwards inside; `lengths` [B] marks each row's real tokens."""
        self._phase, self._lengths = phase, lengths.cpu()
        try:
            yield self
        finally:
            self._phase, self._lengths = None, None

    def clear(self) -> None:
        self.maps.clear()

    def counts(self) -> torch.Tensor:
        """float64 [n_layers, 2]: (changed expert choices, k * tokens) of this rank, before vs after."""
        out = torch.zeros(len(self.routers), 2, dtype=torch.float64)
        before, after = self.maps.get("before", {}), self.maps.get("after", {})
        for i, (layer, _) in enumerate(self.routers):
            b, a = before.get(layer, []), after.get(layer, [])
            if len(b) != len(a):
                raise RuntimeError(f"layer {layer}: {len(b)} forwards captured before the step, {len(a)} after")
            for mb, ma in zip(b, a):
                if mb.shape != ma.shape:
                    raise RuntimeError(f"layer {layer}: routing maps of different shapes {mb.shape} vs {ma.shape}")
                out[i, 0] += (mb & ~ma).sum().item()
                out[i, 1] += mb.sum().item()  # = k * tokens (each row has exactly k experts set)
        return out

    def expert_load(self) -> torch.Tensor:
        """float64 [n_layers, experts]: tokens routed to each expert in the forwards captured before the step."""
        experts = self.routers[0][1].config.num_moe_experts if self.routers else 0
        out = torch.zeros(len(self.routers), experts, dtype=torch.float64)
        for i, (layer, _) in enumerate(self.routers):
            for routing_map in self.maps.get("before", {}).get(layer, []):
                out[i] += routing_map.sum(0).double()
        return out

    def churn_metrics(self, group=None) -> dict[str, float]:
        """Churn per layer and the mean over layers, and the expert load of the step's forwards, counts summed over
        `group` (default: all ranks)."""
        counts, load = self.counts(), self.expert_load()
        if dist.is_available() and dist.is_initialized():
            both = torch.cat([counts, load], dim=1).to(comm_device(group))
            dist.all_reduce(both, group=group)
            counts, load = both[:, :2].cpu(), both[:, 2:].cpu()
        layers = [layer for layer, _ in self.routers]
        return compute_router_churn(layers, counts) | compute_expert_load(layers, load)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def comm_device(group=None) -> torch.device:
    """Where tensors for collectives on `group` must live: the current GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def compute_expert_load(layers: list[int], load: torch.Tensor) -> dict[str, float]:
    """load [n_layers, experts] (tokens per expert) -> {"moe/expert_load_max_over_mean_l{i}": the busiest expert's
    tokens over the mean expert's (1 = balanced, E = one expert takes all), "moe/expert_load_max_over_mean": the
    mean over layers}. A layer that routed no token is left out."""
    out = {}
    for layer, row in zip(layers, load):
        if row.sum() > 0:
            out[f"moe/expert_load_max_over_mean_l{layer}"] = float(row.max() / row.mean())
    values = list(out.values())
    if values:
        out["moe/expert_load_max_over_mean"] = sum(values) / len(values)
    return out


def compute_router_churn(layers: list[int], counts: torch.Tensor) -> dict[str, float]:
    """counts [n_layers, 2] (changed, total choices) -> {"moe/router_churn_l{i}": ..., "moe/router_churn": mean}."""
    if not layers:
        return {}
    churn = (counts[:, 0] / counts[:, 1].clamp(min=1)).tolist()
    out = {f"moe/router_churn_l{layer}": c for layer, c in zip(layers, churn)}
    out["moe/router_churn"] = sum(churn) / len(churn)
    return out
