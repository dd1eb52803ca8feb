"""Multi-token-prediction (MTP) layers, as the released GLM-4.5 and DeepSeek-V3 / Kimi-K2 checkpoints carry them:
`num_nextn_predict_layers` more layers after the decoder, under `model.layers.{num_hidden_layers + j}.`.

    is_mtp_tensor(cfg, name)                # a tensor of those layers (config.json dict, HF tensor name)
    add_mtp_layers(model, out_dir, n=1)     # tiny models: after save_pretrained, tensors into model.safetensors

One MTP layer (DeepSeek-V3's and GLM-4.5's layout, what vLLM's *_mtp.py models read) is a decoder layer of the
model's own kind (its self_attn.* and MoE mlp.* tensors, its two norms) plus `embed_tokens.weight` [V, H], `enorm` /
`hnorm` (RMSNorm weights of the embedding and of the hidden state), `eh_proj.weight` [H, 2H] (the two joined) and
`shared_head.norm.weight` / `shared_head.head.weight` [V, H]. transformers builds none of it (it lists these layers
as keys to ignore), neither does the trainer (families' `ignored_hf_tensor`), nor vLLM's sampler: the tensors are
here so that a checkpoint with them loads, trains and exports complete (trainer/weights/hf_export.py copies them),
and an engine started from one takes the trainer's pushes, which never hold them (rollout/weight_sync.py). The rule is
vLLM's (`get_spec_layer_idx_from_weight_name`): layers num_hidden_layers .. + num_nextn_predict_layers - 1. No
torch at import (the trainer's family registry, which the preflight reads, uses `is_mtp_tensor`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def is_mtp_tensor(cfg: dict, name: str) -> bool:
    """Whether HF tensor `name` belongs to a multi-token-prediction layer of the config.json dict `cfg`."""
    extra = int(cfg.get("num_nextn_predict_layers") or 0)
    m = _LAYER_INDEX.match(name)
    return bool(extra) and m is not None and 0 <= int(m.group(1)) - int(cfg["num_hidden_layers"]) < extra


def mtp_tensors(model, n: int, seed: int = 1) -> dict:
    """The tensors of `n` random MTP layers for a transformers CausalLM `model` (its config's sizes, its decoder
    layer class; weights of its initializer_range std, norm weights 1 + N(0, 0.1))."""
    import torch

    config = model.config
    layer_cls = type(model.model.layers[-1])
    hidden, vocab, std = config.hidden_size, config.vocab_size, config.initializer_range
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for j in range(n):
        index = config.num_hidden_layers + j
        prefix = f"model.layers.{index}."
        layer = layer_cls(config, index)  # the last decoder layer's kind: MoE past first_k_dense_replace
        for name, t in _per_expert(layer.state_dict()).items():
            out[prefix + name] = _random_like(name, t, std, gen)
        extra = {"embed_tokens.weight": (vocab, hidden), "enorm.weight": (hidden,), "hnorm.weight": (hidden,),
                 "eh_proj.weight": (hidden, 2 * hidden), "shared_head.norm.weight": (hidden,),
                 "shared_head.head.weight": (vocab, hidden)}
        for name, shape in extra.items():
            out[prefix + name] = _random_like(name, torch.empty(shape), std, gen)
    return out


def _per_expert(state: dict) -> dict:
    """transformers 5's fused experts (`mlp.experts.gate_up_proj` [E, 2F, H], `down_proj` [E, H, F]) under the
    per-expert names save_pretrained writes and released checkpoints hold (`mlp.experts.{e}.gate_proj.weight`)."""
    out = {}
    for name, t in state.items():
        if name == "mlp.experts.gate_up_proj":
            for e, (gate, up) in enumerate(zip(*t.chunk(2, dim=1))):
                out[f"mlp.experts.{e}.gate_proj.weight"], out[f"mlp.experts.{e}.up_proj.weight"] = gate, up
        elif name == "mlp.experts.down_proj":
            for e, down in enumerate(t):
                out[f"mlp.experts.{e}.down_proj.weight"] = down
        else:
            out[name] = t
    return out


def _random_like(name: str, t, std: float, gen):
    import torch

    noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
    if "norm" in name and name.endswith(".weight"):
        return 1.0 + 0.1 * noise
    return noise * std


def add_mtp_layers(model, out_dir: str | Path, n: int) -> None:
    """Write `n` MTP layers into `out_dir`'s model.safetensors (saved by `model.save_pretrained`, one file) and set
    config.json's num_nextn_predict_layers to n."""
    from safetensors.torch import load_file, save_file

    out_dir = Path(out_dir)
    weights = out_dir / "model.safetensors"
    state = load_file(str(weights)) | mtp_tensors(model, n)
    save_file(state, str(weights), metadata={"format": "pt"})
    path = out_dir / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"num_nextn_predict_layers": n}, indent=1))
