"""LoRA on Megatron's parallel linears, TP- and EP-aware, with the base model frozen.

    adapters = apply_lora(gpt, spec, cfg)     # cfg: gspo_ray.config.LoRAConfig; before build_ddp
    y = W x + (alpha / r) * B (A dropout(x))   # every targeted linear, per HF target (q_proj, ..., down_proj)

Each targeted Megatron linear gets a `lora` child (a `ParallelLoRA`) and a forward hook that adds its output, so
parameter names stay Megatron's (`decoder.layers.0.self_attention.linear_qkv.lora.pairs.q_proj.A`) and DDP,
the optimizer and checkpoints see the adapters as ordinary parameters. Fused Megatron linears hold one adapter per HF
target: `linear_qkv` -> q_proj / k_proj / v_proj (their outputs interleaved per query group, as the base rows
are), `linear_fc1` -> gate_proj / up_proj ([gate; up]), `linear_proj` -> o_proj, `linear_fc2` -> down_proj; the
same for each MoE expert's linear_fc1 / linear_fc2 (SequentialMLP, expert-TP 1, experts split over EP) and for
DeepSeekMoE's shared experts (`mlp.shared_experts.linear_fc1/2`, TP-split like a dense MLP, of their own width).
Multi-latent attention (attention/mla.py): `linear_q_proj` -> q_proj (no q_lora_rank), `linear_q_down_proj` ->
q_a_proj, `linear_q_up_proj` -> q_b_proj, `linear_kv_up_proj` -> kv_b_proj (all column-parallel),
`linear_kv_down_proj` -> kv_a_proj_with_mqa (replicated, compat/megatron_mla_tp_grad.py), `linear_proj` -> o_proj
(its input heads x v_head_dim wide).

Tensor parallelism (sizes per TP rank; always with sequence parallelism, which build_model sets at TP > 1; an
adapter on a TP linear without it is refused):
- column-parallel base (W rows split): A [r, in] replicated, B [out / tp, r] split on output rows. The input
  arrives split on tokens: h = A x is computed on the local tokens and all-gathered (r numbers a token instead of
  the hidden size), its gradient reduce-scattered; A's gradient, a sum over all tokens, is all-reduced over TP by
  `copy_to_tensor_model_parallel_region` applied to A itself.
- row-parallel base (W columns split): A [r, in / tp] split on input columns, B [out, r] replicated; the partial h
  is reduce-scattered onto token shards, then B's gradient all-reduced.
- experts: local matmuls (the dispatcher moved the tokens; expert-TP is 1), adapter grads reduced over the expert
  data-parallel group like the expert weights (`allreduce=False` copied from the base weight).
- replicated base (MLA's kv_down: every rank the whole weight, its own sequence-parallel tokens): A and B whole,
  local matmuls, both factors passed through `copy_to_tensor_model_parallel_region` so their gradients (each rank's
  tokens' part) are summed over TP in the backward.

Linear classes (LINEAR_CLASSES, matched by class name along the MRO: Transformer Engine does not import on a
machine without CUDA, so its classes are never imported here): Megatron's local ColumnParallelLinear /
RowParallelLinear and Transformer Engine's wrappers (megatron/core/extensions/transformer_engine.py), all of whose
forwards return (output, bias). TELayerNormColumnParallelLinear normalises its input inside the GEMM and Megatron
builds it with `return_layernorm_output=False` (its forward then returns a single tensor that the wrapper pairs with
None); turning that flag on after construction would change TE's return value under Megatron's wrapper, so the
adapter recomputes the normed input itself: RMSNorm(x) with the module's `layer_norm_weight` and `eps` (one
[tokens, hidden] norm, and its gradient flows to x as HF's `lora_A(norm(x))` does). TE's grouped linears
(TEGroupedMLP, grouped GEMM: one module per projection, local expert j's weight `weight{j}`, forward(x, m_splits))
get one view per local expert at `experts.local_experts.{j}.linear_fc{1,2}`, the names SequentialMLP's expert
linears have, so adapters, checkpoints and PEFT exports are the same with grouped GEMM or without; the forward hook
splits the grouped input and output by m_splits. Not run on a GPU (TE does not install here): the class names,
attributes and return conventions are megatron-core 0.16.1's and TE's documented ones, tested with same-named
stand-ins (tests/trainer/test_lora_te.py).

Frozen base: every base parameter has requires_grad False, so Megatron runs `linear_with_frozen_weight` (no weight
gradient matmul), DDP allocates no gradient buffer and the optimizer holds no state for it. Adapters are fp32 (the
input is cast to fp32, the output back to the base's dtype), on their base weight's device.

Init (PEFT's): A kaiming-uniform(a=sqrt 5) over the full tensor, B = 0, drawn from a generator seeded by the
trainer seed and the adapter's HF name, so every TP/EP layout starts from the same full adapter.
"""
from __future__ import annotations

import contextlib
import math
import re
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gspo_ray.config.lora import LoRAConfig
from gspo_ray.trainer.families import family_of
from gspo_ray.trainer.families.base import DENSE_LORA_TARGETS
from gspo_ray.trainer.weights.bridge import is_lora_param, param_map
from gspo_ray.trainer.model_spec import ModelSpec

_LAYER = r"decoder\.layers\.(\d+)\."
# Megatron linear (module name) -> (HF targets it holds, in output order; output layout; parallel kind)
_LINEARS: list[tuple[str, tuple[str, ...], str, str]] = [
    (_LAYER + r"self_attention\.linear_qkv", ("q_proj", "k_proj", "v_proj"), "qkv", "col"),
    (_LAYER + r"self_attention\.linear_proj", ("o_proj",), "copy", "row"),
    (_LAYER + r"self_attention\.linear_q_proj", ("q_proj",), "copy", "col"),
    (_LAYER + r"self_attention\.linear_q_down_proj", ("q_a_proj",), "copy", "col"),
    (_LAYER + r"self_attention\.linear_q_up_proj", ("q_b_proj",), "copy", "col"),
    (_LAYER + r"self_attention\.linear_kv_down_proj", ("kv_a_proj_with_mqa",), "copy", "rep"),
    (_LAYER + r"self_attention\.linear_kv_up_proj", ("kv_b_proj",), "copy", "col"),
    (_LAYER + r"mlp\.(?:shared_experts\.)?linear_fc1", ("gate_proj", "up_proj"), "gated", "col"),
    (_LAYER + r"mlp\.(?:shared_experts\.)?linear_fc2", ("down_proj",), "copy", "row"),
    (_LAYER + r"mlp\.experts\.local_experts\.(\d+)\.linear_fc1", ("gate_proj", "up_proj"), "gated", "col"),
    (_LAYER + r"mlp\.experts\.local_experts\.(\d+)\.linear_fc2", ("down_proj",), "copy", "row"),
]


@dataclass(frozen=True)
class LinearTarget:
    """One Megatron linear an adapter wraps: its targets, layout, TP kind, and the full (TP 1) sizes."""

    name: str                        # Megatron module name
    targets: tuple[str, ...]         # HF targets adapted here (a subset of the linear's, in output order)
    all_targets: tuple[str, ...]     # every HF target the fused linear holds
    layout: str                      # "qkv" | "gated" | "copy"
    kind: str                        # "col" | "row" | "rep" (replicated: no TP split)
    layer: int
    local_expert: int | None         # expert index on this EP rank (None: dense)


@dataclass(frozen=True)
class LinearKind:
    """How a linear class partitions and what its forward takes (see the module doc)."""

    parallel: str                    # "col" (output rows split over TP) | "row" (input columns split)
    fused_norm: bool = False         # normalises its input first (TE LayerNormLinear): the adapter reads norm(x)
    grouped: bool = False            # one GEMM per local expert (TE GroupedLinear): weight{j}, forward(x, m_splits)


# class name -> kind: Megatron's local linears (tensor_parallel/layers.py) and Transformer Engine's wrappers
LINEAR_CLASSES: dict[str, LinearKind] = {
    "ColumnParallelLinear": LinearKind("col"),
    "RowParallelLinear": LinearKind("row"),
    "TEColumnParallelLinear": LinearKind("col"),
    "TERowParallelLinear": LinearKind("row"),
    "TELayerNormColumnParallelLinear": LinearKind("col", fused_norm=True),
    "TEColumnParallelGroupedLinear": LinearKind("col", grouped=True),
    "TERowParallelGroupedLinear": LinearKind("row", grouped=True),
}


def linear_kind(module: nn.Module) -> LinearKind | None:
    """The LinearKind of a module's class (or of the nearest base class the registry knows), None when none (then
    apply_lora takes the partitioning from the module's name, _LINEARS, and the plain (output, bias) hook)."""
    for cls in type(module).__mro__:
        if cls.__name__ in LINEAR_CLASSES:
            return LINEAR_CLASSES[cls.__name__]
    return None


def match_linear(module_name: str, targets: list[str]) -> LinearTarget | None:
    """The LinearTarget of a Megatron module name, or None when it holds none of `targets`."""
    for pattern, names, layout, kind in _LINEARS:
        m = re.fullmatch(pattern, module_name)
        if m:
            chosen = tuple(t for t in names if t in targets)
            if not chosen:
                return None
            expert = int(m.group(2)) if m.lastindex and m.lastindex > 1 else None
            return LinearTarget(module_name, chosen, names, layout, kind, int(m.group(1)), expert)
    return None


_ADAPTER_PARAM = re.compile(r"(?P<module>.+)\.lora\.pairs\.(?P<target>[a-z_]+)\.(?P<factor>[AB])")


def adapter_tp_split(param_name: str) -> str:
    """How TP splits an adapter factor (`<linear>.lora.pairs.<target>.A|B`), per the module doc: "col" (dim 0:
    B of a column-parallel linear), "row" (dim 1: A of a row-parallel linear) or "none" (the replicated factor,
    and every expert adapter: expert-TP is 1). KeyError for a name that is no adapter of a known linear."""
    m = _ADAPTER_PARAM.fullmatch(param_name)
    t = match_linear(m["module"], [m["target"]]) if m else None
    if t is None:
        raise KeyError(f"{param_name!r} is no adapter of a known linear")
    if t.local_expert is not None or t.kind == "rep":
        return "none"
    split = (m["factor"] == "B") == (t.kind == "col")  # column: B split on rows; row: A split on columns
    return t.kind if split else "none"


def _mlp_width(t: LinearTarget, spec: ModelSpec) -> int:
    if t.local_expert is not None:
        return spec.moe_ffn_hidden_size
    return spec.shared_expert_ffn_hidden_size if ".shared_experts." in t.name else spec.ffn_hidden_size


def full_out_sizes(t: LinearTarget, spec: ModelSpec) -> dict[str, int]:
    """Output rows of each HF target at TP 1."""
    d, ffn, mla = spec.head_dim, _mlp_width(t, spec), spec.extra.get("mla")
    sizes = {"q_proj": spec.num_heads * d, "k_proj": spec.num_kv_heads * d, "v_proj": spec.num_kv_heads * d,
             "o_proj": spec.hidden_size, "gate_proj": ffn, "up_proj": ffn, "down_proj": spec.hidden_size}
    if mla:  # attention/mla.py's options: per head qk_head_dim (no rope) + qk_pos_emb_head_dim (rope), v_head_dim
        q_head = mla["qk_head_dim"] + mla["qk_pos_emb_head_dim"]
        sizes |= {"q_proj": spec.num_heads * q_head, "q_a_proj": mla["q_lora_rank"],
                  "q_b_proj": spec.num_heads * q_head,
                  "kv_a_proj_with_mqa": mla["kv_lora_rank"] + mla["qk_pos_emb_head_dim"],
                  "kv_b_proj": spec.num_heads * (mla["qk_head_dim"] + mla["v_head_dim"])}
    return {k: sizes[k] for k in t.targets}


def full_in_size(t: LinearTarget, spec: ModelSpec) -> int:
    mla = spec.extra.get("mla")
    sizes = {"o_proj": spec.num_heads * (mla["v_head_dim"] if mla else spec.head_dim),
             "down_proj": _mlp_width(t, spec)}
    if mla:
        sizes |= {"q_b_proj": mla["q_lora_rank"], "kv_b_proj": mla["kv_lora_rank"]}
    return sizes.get(t.targets[0], spec.hidden_size)


class LoRAPair(nn.Module):
    """A [r, in_local] and B [out_local, r] of one HF target, fp32, on `device` (the base weight's: a CUDA model's
    adapters on the CPU fail Megatron's optimizer type check and the first forward's matmul)."""

    def __init__(self, rank: int, in_local: int, out_local: int, device: torch.device | str | None = None):
        super().__init__()
        self.A = nn.Parameter(torch.zeros(rank, in_local, dtype=torch.float32, device=device))
        self.B = nn.Parameter(torch.zeros(out_local, rank, dtype=torch.float32, device=device))


class ParallelLoRA(nn.Module):
    """The adapters of one Megatron linear (one LoRAPair per HF target) and its forward (see the module doc)."""

    def __init__(self, t: LinearTarget, spec: ModelSpec, cfg: LoRAConfig, base: nn.Module):
        super().__init__()
        self.target, self.scale, self.dropout = t, cfg.scale, cfg.dropout
        self.bypass = False  # the reference policy's forward: the base linear alone (reference_adapters)
        group = getattr(base, "tp_group", None)
        tp = group.size() if group is not None else 1
        # a replicated base at TP > 1: whole factors, their gradients summed over TP (`_replica`)
        self.replica_group = group if t.kind == "rep" and tp > 1 else None
        self.local = bool(getattr(base, "explicit_expert_comm", False)) or tp == 1 or t.kind == "rep"  # no shards
        self.tp, self.tp_group = (1, None) if self.local else (tp, group)
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and not self.local
        if not self.local and not self.sequence_parallel:  # build_model sets SP at TP > 1; nothing else is written
            raise ValueError(f"{t.name}: LoRA at TP {tp} needs sequence parallelism (build_model's default)")
        self.groups = spec.num_kv_heads // self.tp  # local query groups (qkv layout)
        outs, inp = full_out_sizes(t, spec), full_in_size(t, spec)
        col = t.kind == "col"
        self.qkv_widths = {n: s // self.tp for n, s in full_out_sizes(
            LinearTarget(t.name, t.all_targets, t.all_targets, t.layout, t.kind, t.layer, t.local_expert),
            spec).items()} if t.layout == "qkv" else {}
        weight = getattr(base, "weight", None)
        device = weight.device if isinstance(weight, Tensor) else None
        self.pairs = nn.ModuleDict({
            n: LoRAPair(cfg.rank, inp if col else inp // self.tp, s // self.tp if col else s, device)
            for n, s in outs.items()})

    def _replica(self, p: Tensor) -> Tensor:
        """A factor of a replicated linear: identity forward, its gradient summed over TP (each rank's tokens)."""
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        if self.replica_group is not None:
            return copy_to_tensor_model_parallel_region(p, group=self.replica_group)
        return p

    def _weight(self, p: Tensor) -> Tensor:
        """A replicated factor whose gradient is a sum over TP ranks' token shards (sequence parallelism)."""
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        if self.sequence_parallel:
            return copy_to_tensor_model_parallel_region(p, group=self.tp_group)
        return p

    def forward(self, x: Tensor) -> Tensor:
        """The adapter's contribution to the base linear's output (same shape and layout), in x's dtype."""
        from megatron.core.tensor_parallel import mappings as mp

        h_in = F.dropout(x.float(), self.dropout, self.training) if self.dropout else x.float()
        outs = {}
        for name, pair in self.pairs.items():
            if self.target.kind == "rep":
                outs[name] = ((h_in @ self._replica(pair.A).t()) @ self._replica(pair.B).t()) * self.scale
            elif self.target.kind == "col":
                h = h_in @ self._weight(pair.A).t()
                if self.sequence_parallel:  # tokens split over TP: gather r numbers a token, not the hidden size
                    h = mp.gather_from_sequence_parallel_region(h, True, group=self.tp_group)
                outs[name] = (h @ pair.B.t()) * self.scale
            else:
                h = h_in @ pair.A.t()  # partial over TP (A split on the input columns)
                if self.sequence_parallel:
                    h = mp.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
                outs[name] = (h @ self._weight(pair.B).t()) * self.scale
        return self._assemble(outs).to(x.dtype)

    def add_to(self, out: Tensor, x: Tensor) -> Tensor:
        """out + the adapter's contribution for input x. Without TP collectives (TP 1, experts) and in fp32, the
        targets of a fused linear run as one product: h = x [A_1; A_2; ...]^T, then out + h S with S
        [sum r, out_local] the B's placed in the base's output layout (block-diagonal, interleaved for qkv) and the
        scale folded in, added by one addmm: two small matmuls a linear instead of two per target, and no
        [tokens, out] temporaries for the scale, the concatenation and the sum. Equal to out + self(x) up to
        float summation order."""
        if (not self.local or self.replica_group is not None or out.dtype != torch.float32
                or x.dtype != torch.float32):
            return out + self(x)
        pairs = list(self.pairs.values())
        a = pairs[0].A if len(pairs) == 1 else torch.cat([p.A for p in pairs])
        h_in = F.dropout(x, self.dropout, self.training) if self.dropout else x
        h = h_in.reshape(-1, h_in.shape[-1]) @ a.t()
        return torch.addmm(out.reshape(-1, out.shape[-1]), h, self._stacked_b()).view(out.shape)

    def _stacked_b(self) -> Tensor:
        """scale * [B_1; B_2; ...] as one [sum r, out_local] factor in the base's output layout: target j's
        B_j^T sits in rows of j's rank block, zeros elsewhere, and _assemble lays its columns out like the
        base's rows."""
        ranks = [p.B.shape[1] for p in self.pairs.values()]
        total, blocks, offset = sum(ranks), {}, 0
        for (name, pair), r in zip(self.pairs.items(), ranks):
            blocks[name] = F.pad(pair.B.t() * self.scale, (0, 0, offset, total - offset - r))
            offset += r
        return self._assemble(blocks)

    def _assemble(self, outs: dict[str, Tensor]) -> Tensor:
        t = self.target
        if t.layout == "copy":
            return outs[t.targets[0]]
        some = next(iter(outs.values()))
        lead = some.shape[:-1]
        widths = self.qkv_widths if t.layout == "qkv" else {n: some.shape[-1] for n in t.all_targets}
        parts = [outs[n] if n in outs else some.new_zeros(*lead, w) for n, w in widths.items()]
        if t.layout == "gated":
            return torch.cat(parts, dim=-1)
        g = self.groups  # qkv: per local query group [q heads of the group | k | v]
        return torch.cat([p.reshape(*lead, g, -1) for p in parts], dim=-1).reshape(*lead, -1)

    @torch.no_grad()
    def delta_weight(self) -> Tensor:
        """scale * B A of every target, in the base weight's local layout [out_local, in_local] (fp32)."""
        outs = {n: (p.B @ p.A).t() * self.scale for n, p in self.pairs.items()}  # [in_local, out_s_local]
        return self._assemble(outs).t()


def _add_adapter_output(module: nn.Module, inputs: tuple, output):
    """Forward hook of an adapted linear: Megatron's and TE's linears return (output, bias)."""
    if module.lora.bypass:
        return output
    out, bias = output
    return module.lora.add_to(out, inputs[0]), bias


def fused_norm_input(module: nn.Module, x: Tensor) -> Tensor:
    """What a TE LayerNormLinear feeds its GEMM: RMSNorm(x) * layer_norm_weight (1 + weight with
    zero_centered_gamma), computed in fp32 like TE, in x's dtype."""
    if getattr(module, "normalization", "RMSNorm") != "RMSNorm":
        raise NotImplementedError(f"LoRA on a fused {module.normalization} linear (only RMSNorm is built)")
    weight = module.layer_norm_weight.float()
    if getattr(module, "zero_centered_gamma", False):
        weight = weight + 1
    return F.rms_norm(x.float(), (x.shape[-1],), weight, module.eps).to(x.dtype)


def _add_adapter_output_normed(module: nn.Module, inputs: tuple, output):
    """Forward hook of an adapted TE LayerNormLinear: the adapter reads the normed input (see the module doc)."""
    if module.lora.bypass:
        return output
    out, bias = output
    return module.lora.add_to(out, fused_norm_input(module, inputs[0])), bias


class GroupedExpertView(nn.Module):
    """Local expert `index` of a grouped linear seen as one linear, the holder of that expert's adapter: `weight` is
    the grouped linear's `weight{index}` (not registered here: the parameter stays the grouped linear's)."""

    explicit_expert_comm = True      # expert-TP 1, tokens moved by the dispatcher: the adapter has no TP collectives

    def __init__(self, grouped: nn.Module, index: int):
        super().__init__()
        object.__setattr__(self, "grouped", grouped)  # a plain attribute: not a child module, nothing registered twice
        self.index = index

    @property
    def weight(self) -> Tensor:
        return getattr(self.grouped, f"weight{self.index}")


def _add_grouped_adapter_output(module: nn.Module, args: tuple, kwargs: dict, output):
    """Forward hook of an adapted grouped linear, forward(x, m_splits): rows of x are local expert 0's m_splits[0]
    tokens, then expert 1's, ...; each expert's rows get its own adapter."""
    out, bias = output
    x = args[0]
    splits = args[1] if len(args) > 1 else kwargs["m_splits"]
    sizes = [int(n) for n in splits]
    pieces = []
    for view, o, xi in zip(module.lora_views, out.split(sizes), x.split(sizes)):
        pieces.append(o if view.lora.bypass or not len(xi) else view.lora.add_to(o, xi))
    return torch.cat(pieces), bias


def _expert_views(model: nn.Module, name: str, grouped: nn.Module) -> list[tuple[str, GroupedExpertView]]:
    """One GroupedExpertView per local expert of the grouped linear `name` (`...mlp.experts.linear_fc1`), placed
    at `...mlp.experts.local_experts.{j}.linear_fc1` (SequentialMLP's names). Returns (name, view) pairs."""
    parent_name, _, proj = name.rpartition(".")
    experts = model.get_submodule(parent_name)
    if not hasattr(experts, "local_experts"):
        experts.local_experts = nn.ModuleList(nn.Module() for _ in range(grouped.num_gemms))
    views = [GroupedExpertView(grouped, j) for j in range(grouped.num_gemms)]
    for j, view in enumerate(views):
        setattr(experts.local_experts[j], proj, view)
    object.__setattr__(grouped, "lora_views", views)  # plain list: the views are registered under local_experts
    return [(f"{parent_name}.local_experts.{j}.{proj}", view) for j, view in enumerate(views)]


@contextlib.contextmanager
def reference_adapters(model: nn.Module, state: dict[str, Tensor] | None = None):
    """Within the block `model` computes the reference policy of a LoRA run, in eval mode, with no second model:
    the base alone (`state` None: every adapter bypassed), or the adapters holding `state` (lora_state names: the
    adapter the run started from, trainer.lora.init_from). The trained adapters come back afterwards, bit for bit."""
    was_training = model.training
    linears = [m for _, m in adapted_linears(model)]
    params = dict(model.named_parameters())
    saved = {}
    model.eval()
    try:
        with torch.no_grad():
            if state is None:
                for m in linears:
                    m.lora.bypass = True
            for k, v in (state or {}).items():
                saved[k] = params[k].detach().clone()
                params[k].copy_(v)
        yield
    finally:
        with torch.no_grad():
            for m in linears:
                m.lora.bypass = False
            for k, v in saved.items():
                params[k].copy_(v)
        model.train(was_training)


def adapted_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(Megatron module name, linear) of every linear carrying an adapter, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(getattr(m, "lora", None), ParallelLoRA)]


def apply_lora(model: nn.Module, spec: ModelSpec, cfg: LoRAConfig, seed: int = 0) -> list[str]:
    """Freeze `model` and wrap the targeted linears (see the module doc). Returns the adapted module names.
    Raises ValueError when a target is not one the model's family offers (`Family.lora_targets`), when no linear
    matches, or when a TP split does not divide (it cannot: sizes come from the base linears, which TP already
    divides)."""
    family = family_of(spec.arch)
    offered = family.lora_targets if family is not None else DENSE_LORA_TARGETS
    unknown = [t for t in cfg.target_modules if t not in offered]
    if unknown:
        raise ValueError(f"trainer.lora.target_modules: {unknown[0]!r} is not a linear of {spec.arch} models; "
                         f"valid: {', '.join(offered)}")
    model.requires_grad_(False)
    done = []
    for name, module in list(model.named_modules()):
        kind = linear_kind(module)
        if kind is not None and kind.grouped:
            parent, _, proj = name.rpartition(".")
            if match_linear(f"{parent}.local_experts.0.{proj}", cfg.target_modules) is None:
                continue  # no targeted projection here: no views either
            views = _expert_views(model, name, module)
            for view_name, view in views:
                _wrap(view_name, view, spec, cfg, seed, match_linear(view_name, cfg.target_modules))
            module.register_forward_hook(_add_grouped_adapter_output, with_kwargs=True)
            done += [n for n, _ in views]
            continue
        t = match_linear(name, cfg.target_modules)
        if t is None or isinstance(module, GroupedExpertView):
            continue
        kind = kind or LinearKind(t.kind)  # a class the registry does not name: the module name's rule decides
        if kind.parallel != t.kind:
            raise ValueError(f"trainer.lora: {name} is a {type(module).__name__}, whose partitioning is not the "
                             f"{'column' if t.kind == 'col' else 'row'}-parallel one this linear needs")
        _wrap(name, module, spec, cfg, seed, t)
        module.register_forward_hook(_add_adapter_output_normed if kind.fused_norm else _add_adapter_output)
        done.append(name)
    if not done:
        raise ValueError(f"trainer.lora.target_modules {cfg.target_modules}: no linear of this model matches")
    return done


def _wrap(name: str, module: nn.Module, spec: ModelSpec, cfg: LoRAConfig, seed: int, t: LinearTarget) -> None:
    """Give `module` its ParallelLoRA, initialised from the full (TP 1) adapter of each target."""
    lora = ParallelLoRA(t, spec, cfg, module)
    module.lora = lora
    for target, pair in lora.pairs.items():
        hf = adapter_hf_module(t, target, spec)
        a, b = init_full_pair(hf, cfg.rank, full_in_size(t, spec), full_out_sizes(t, spec)[target], seed)
        shard_pair(pair, lora, a, b, where=name)
        _mark_parallel(pair, lora, module)


def _mark_parallel(pair: LoRAPair, lora: ParallelLoRA, base: nn.Module) -> None:
    """Megatron's parameter attributes: TP-split factors count once per shard in the grad norm; expert adapters
    are reduced with the experts (not over the dense data-parallel group)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    if not lora.local:
        split, dim = (pair.B, 0) if lora.target.kind == "col" else (pair.A, 1)
        set_tensor_model_parallel_attributes(split, True, dim, 1)
    allreduce = getattr(base.weight, "allreduce", True)
    for p in (pair.A, pair.B):
        p.allreduce = allreduce


def lora_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' entries of the model state dict (what a LoRA checkpoint holds)."""
    return {k: v for k, v in model.state_dict().items() if is_lora_param(k)}


def load_lora_state(model: nn.Module, state: dict[str, Tensor], where: str = "checkpoint") -> None:
    """Load adapter tensors into `model` (base untouched). Every adapter of the model must be in `state`, with
    its shape; ValueError naming the first mismatch otherwise."""
    own = lora_state(model)
    missing = sorted(set(own) - set(state))
    extra = sorted(k for k in state if is_lora_param(k) and k not in own)
    if missing or extra:
        raise ValueError(f"{where}: adapters differ from this run's trainer.lora (missing {missing[:2]}, "
                         f"unexpected {extra[:2]})")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k in own:
            if tuple(state[k].shape) != tuple(params[k].shape):
                raise ValueError(f"{where}: adapter {k} has shape {tuple(state[k].shape)}, this run "
                                 f"{tuple(params[k].shape)} (another base model or rank)")
            params[k].copy_(state[k])


def count_params(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of this rank."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def kaiming_a(rank: int, fan_in: int, gen: torch.Generator) -> Tensor:
    """PEFT's A init: kaiming_uniform_(a=sqrt(5)) -> U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=gen, dtype=torch.float64) * 2 - 1).mul(bound).float()


def name_seed(name: str, seed: int) -> int:
    return zlib.crc32(f"{seed}:{name}".encode())


# ---- full (TP 1) adapters <-> this rank's shards ---------------------------------------------------------------
def _ep_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank()


def _tp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank()


def adapter_hf_module(t: LinearTarget, target: str, spec: ModelSpec, ep_rank: int | None = None) -> str:
    """HF module path of one target of a Megatron linear (`model.layers.0.self_attn.q_proj`); experts by their
    global index on EP rank `ep_rank` (default: this rank)."""
    pm = param_map(t.name + ".weight", spec.arch)
    names = pm.hf_names
    if pm.local_expert is not None:
        ep = _ep_rank() if ep_rank is None else ep_rank
        names = pm.for_expert(ep * spec.num_local_experts + pm.local_expert)
    return names[t.all_targets.index(target)].removesuffix(".weight")


def init_full_pair(hf_module: str, rank: int, fan_in: int, out: int, seed: int) -> tuple[Tensor, Tensor]:
    """PEFT's default init of one full adapter: A kaiming-uniform, B zeros (seeded by name: layout-independent)."""
    gen = torch.Generator().manual_seed(name_seed(hf_module, seed))
    return kaiming_a(rank, fan_in, gen), torch.zeros(out, rank)


def _local_rows(full: Tensor, lora: ParallelLoRA, dim: int) -> Tensor:
    if lora.local:
        return full
    return full.chunk(lora.tp, dim=dim)[_tp_rank()]


@torch.no_grad()
def shard_pair(pair: LoRAPair, lora: ParallelLoRA, a_full: Tensor, b_full: Tensor, where: str = "") -> None:
    """Copy this rank's slice of a full (A [r, in], B [out, r]) into `pair` (column: B rows; row: A columns).
    Query heads of one group are contiguous in q_proj's rows and TP splits whole groups, so a rank's q/k/v rows
    are a contiguous chunk of each."""
    col = lora.target.kind == "col"
    a = a_full if col else _local_rows(a_full, lora, 1)
    b = _local_rows(b_full, lora, 0) if col else b_full
    for local, p, label in ((a, pair.A, "lora_A"), (b, pair.B, "lora_B")):
        if tuple(local.shape) != tuple(p.shape):
            raise ValueError(f"{where or 'adapter'}: {label} gives shape {tuple(local.shape)} on this rank, the "
                             f"model needs {tuple(p.shape)} (an adapter of another base model, or another rank)")
        p.copy_(local.to(device=p.device, dtype=p.dtype))
