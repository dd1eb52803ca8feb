"""Global layer names under pipeline parallelism.

    global_layer_name("decoder.layers.0.mlp.linear_fc1.weight", 12) -> "decoder.layers.12.mlp.linear_fc1.weight"
    local_layer_name("decoder.layers.12.mlp.linear_fc1.weight", 12) -> "decoder.layers.0.mlp.linear_fc1.weight"
    layer_index("decoder.layers.12.input_layernorm.weight") -> 12   (None: not a decoder layer's tensor)

Megatron numbers a pipeline stage's `decoder.layers.{i}` from 0 on every stage (the layer's global number is
`layer.layer_number`, from 1). Every name that leaves a rank (checkpoints, HF exports, weight pushes, optimizer
state) is global: layer i of stage s with offset o (build_model's `model.layer_offset`, s x layers / pp) is
`decoder.layers.{i + o}`, the name the same tensor has at PP 1, so files written at one PP size read at another.
Pure string maths (no Megatron import).
"""
from __future__ import annotations

import re

_LAYER = re.compile(r"(^|\.)decoder\.layers\.(\d+)\.")


def _shift(name: str, delta: int) -> str:
    if not delta:
        return name
    m = _LAYER.search(name)
    if m is None:
        return name
    return f"{name[:m.start(2)]}{int(m.group(2)) + delta}{name[m.end(2):]}"


def global_layer_name(name: str, offset: int) -> str:
    """A stage-local parameter name -> its global name (layer index + offset; other names unchanged)."""
    return _shift(name, offset)


def local_layer_name(name: str, offset: int) -> str:
    """Inverse of global_layer_name."""
    return _shift(name, -offset)


def layer_index(name: str) -> int | None:
    """The decoder layer index in a name (global or local, as written), or None for the embedding, the final norm
    and the output layer."""
    m = _LAYER.search(name)
    return int(m.group(2)) if m is not None else None


def layer_offset(model) -> int:
    """The global index of `model`'s first decoder layer (0 at PP 1, and for wrappers that do not say)."""
    while not hasattr(model, "layer_offset") and hasattr(model, "module"):
        model = model.module
    return int(getattr(model, "layer_offset", 0))
