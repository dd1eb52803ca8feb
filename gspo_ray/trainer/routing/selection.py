"""The experts a Megatron router selects, computed from its input the way its routing does (no gradient).

    idx = router_topk(router, hidden)      # hidden [..., H] -> [..., k] expert ids (torch.long)

What Routing Replay (R3's free positions), routing drift and routing agreement compare is the router's *selection*.
A softmax router selects the k largest logits (the softmax is monotone). A DeepSeekMoE router (GLM-4.5,
DeepSeek-V3: families/deepseek_moe.py) selects on `sigmoid(logits) + expert_bias`, the correction bias its weights
never see, optionally group-limited (Megatron's `group_limited_topk`, which the family only lets run where it
ranks groups as transformers and vLLM do): the same maths as megatron.core's `topk_routing_with_score_function`,
whose weights (the unbiased scores of the selected experts) replay keeps by gathering them at the replayed ids.
A router with a bias of its own (gpt-oss) adds it to the logits. Router logits are computed in fp32 (Megatron's `moe_router_dtype` fp32, the DeepSeekMoE families' setting).
"""
from __future__ import annotations

import torch
from gspo_ray.compat.megatron_import import megatron_core  # noqa: F401  (first: megatron without torch.compile)
from megatron.core.transformer.moe.moe_utils import group_limited_topk


def selection_scores(router, hidden: torch.Tensor) -> torch.Tensor:
    """[..., E] fp32 scores whose top-k is the router's selection (softmax routers: the logits)."""
    # a router with a bias of its own (gpt-oss: Megatron's router.bias with add_bias_linear) adds it to the logits
    bias = getattr(router, "bias", None)
    logits = torch.nn.functional.linear(hidden.detach().float(), router.weight.detach().float(),
                                        bias.detach().float() if bias is not None else None)
    if router.config.moe_router_score_function == "softmax":
        return logits if not router.config.moe_router_group_topk else torch.softmax(logits, dim=-1)
    if router.config.moe_router_score_function != "sigmoid":
        raise ValueError(f"router score function {router.config.moe_router_score_function!r} is not handled")
    scores = torch.sigmoid(logits)
    bias = getattr(router, "expert_bias", None)
    return scores + bias.float() if bias is not None else scores


@torch.no_grad()
def router_topk(router, hidden: torch.Tensor) -> torch.Tensor:
    """The router's top-k expert ids [..., k] for `hidden` [..., H] (see the module doc)."""
    scores, k, cfg = selection_scores(router, hidden), router.topk, router.config
    if not cfg.moe_router_group_topk:
        return torch.topk(scores, k, dim=-1).indices
    flat = scores.reshape(-1, scores.shape[-1])
    _, idx = group_limited_topk(flat, k, flat.shape[0], flat.shape[1], cfg.moe_router_num_groups,
                                cfg.moe_router_group_topk)
    return idx.reshape(*scores.shape[:-1], k)
