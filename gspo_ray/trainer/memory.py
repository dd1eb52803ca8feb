"""The memory model of one trainer rank, term by term, before anything is built (`gspo-ray plan`, the preflight).

    shape = MemoryShape.from_hf_config(read_hf_config(model_dir))        # through model_spec / the family registry
    terms = rank_memory(shape, Layout(world=8, tp=2, ep=4, micro_batch_tokens=32768, dtype="bfloat16"))
    terms.total, terms.largest()                                          # bytes; ("activations", 41.2e9)

Terms (bytes on one rank's device; `Layout` says the parallel layout and the trainer's settings):

  weights      every parameter this rank holds in the training dtype: dense ones split over TP (norms and routers
               replicated), experts over EP (expert-TP 1, as the trainer builds them)
  main_params  bf16 training: Megatron's fp32 main copy of the weights (none in fp32, where the weights are the
               main copy); with the distributed optimizer split over DP (dense: world / tp ranks, experts: the
               expert-data-parallel world / ep ranks); with optimizer_cpu_offload in host memory (0 here)
  grads        the gradient buffer: fp32 (grad_reduce_in_fp32 in bf16, and fp32 training), one per parameter held
               (the distributed optimizer reduce-scatters into it; the buffer is whole)
  optimizer    Adam's two fp32 moments, split and offloaded as main_params
  activations  one micro-batch of `micro_batch_tokens` tokens kept from forward to backward, all layers, split over
               TP (sequence parallelism): the elements a token and layer that the local layers save (below),
               experts' top-k copies for MoE layers, fewer with recompute
  logits       the output layer's fp32 [tokens scored, vocab / tp] buffer kept for the backward (logprob_head)
  backward     the layers' backward's working set (a quarter of a layer's activations; with full recompute that
               layer's activations made again besides) beyond the logits, which the head's backward has freed
  engine       a colocated engine's share of the device (Layout.engine_bytes: rollout.gpu_memory_utilization of
               it) beyond the step's activations and logits: the engines sleep while the trainer trains (weights
               to host memory, KV cache freed) and generate while the trainer holds its state only, so the peak
               is the state plus the larger of the two (0 when engines have GPUs of their own)

What a layer keeps, per token (elements of the training dtype), counted from what autograd saves in the local
spec's layers here with attention by segment (saved-tensor hooks on a built model, storages counted once, at two
token counts: docs/scale.md, "Memory"): attention 3h (the residual input, the normed output, its copy into the QKV
projection) + (q + 2 kv) d (the QKV output) + (q + kv) d (RoPE'd queries and keys) + 2 q d (the attention output,
its copy into the output projection) + 4 d (RoPE's cos / sin), QK-norm adding 2 q d + kv d; a dense MLP 3h + 5f
(fc1's 2f, the gated activation's 3f); an MoE layer's MLP 3h + 2E (router) + top_k x (2h + 4F) (each token's
copies dispatched, through the expert MLP, weighted) + 5 x the shared experts' width. Recompute selective
(core_attn, mlp) keeps q d less of the attention and 3h of a dense MLP; full keeps h a layer (its input) for the
recomputed layers. The CUDA kernels save other things (Transformer Engine's fused norms, flash attention's
layout): this is the local spec's count, checked on CPU only.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

GIB = 2 ** 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RECOMPUTE = ("none", "selective", "full")
# The layers' backward's working set beyond the kept activations (the gradients of one layer's intermediates and
# their kernels' temporaries, less what that layer's backward frees as it goes), in layers' worth of activations:
# 0.25 from the tiny-MoE row of the memory bench, the one row where the fused head's logits do not hide it
# (docs/scale.md, "The memory model")
BACKWARD_LAYERS = 0.25


@dataclass(frozen=True)
class MemoryShape:
    """What the memory model reads of a model: its HF config's sizes (`from_hf_config`), or by hand for families
    the trainer has not got yet (`params_by_hand`: the parameter counts are then given, not derived)."""

    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int = 0                 # dense MLP width
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    moe_layers: int = 0          # how many layers have experts
    shared_ffn: int = 0          # shared experts' total width in an MoE layer (by hand: DeepSeek-like)
    tied: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    attn_params: int | None = None       # one layer's attention parameters when not GQA q/k/v/o (by hand)
    params_by_hand: bool = False

    @classmethod
    def from_spec(cls, spec, name: str = "") -> "MemoryShape":
        """From a trainer ModelSpec (model_spec.spec_from_hf_config: the code the trainer builds from)."""
        mla = spec.extra.get("mla") or {}
        return cls(attn_params=mla_attention_params(mla, spec.hidden_size, spec.num_heads) if mla else None,name=name or spec.arch, vocab=spec.vocab_size, hidden=spec.hidden_size, layers=spec.num_layers,
                   heads=spec.num_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                   ffn=spec.ffn_hidden_size, experts=spec.num_experts, top_k=spec.top_k,
                   moe_ffn=spec.moe_ffn_hidden_size, moe_layers=len(spec.moe_layers), tied=spec.tied_embeddings,
                   qk_norm=spec.qk_norm, qkv_bias=spec.qkv_bias,
                   shared_ffn=getattr(spec, "shared_expert_ffn_hidden_size", 0))

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "") -> "MemoryShape":
        """A HF config.json (as a dict) read through model_spec.spec_from_hf_config and the family registry;
        ValueError naming the key for a model the trainer cannot build."""
        from gspo_ray.trainer.model_spec import spec_from_hf_config

        return cls.from_spec(spec_from_hf_config(cfg, "config.json"), name or cfg.get("model_type", ""))

    # ---- parameters ---------------------------------------------------------------------------------------------
    @property
    def dense_layer_params(self) -> int:
        """One layer's parameters outside the experts: attention, norms, the dense MLP or router + shared experts."""
        h, d = self.hidden, self.head_dim
        attn = self.attn_params if self.attn_params is not None else h * (2 * self.heads + 2 * self.kv_heads) * d
        attn += (self.heads + 2 * self.kv_heads) * d if self.qkv_bias else 0
        return attn + 2 * h + (2 * d if self.qk_norm else 0)

    @property
    def expert_params(self) -> int:
        """All routed experts' parameters (gate, up, down each)."""
        return self.moe_layers * self.experts * 3 * self.hidden * self.moe_ffn

    @property
    def dense_params(self) -> int:
        """Everything but the routed experts: embeddings, layers' attention and norms, dense MLPs, routers and
        shared experts."""
        h = self.hidden
        mlp = (self.layers - self.moe_layers) * 3 * h * self.ffn
        moe = self.moe_layers * (self.experts * h + 3 * h * self.shared_ffn)
        return self.vocab * h * (1 if self.tied else 2) + h + self.layers * self.dense_layer_params + mlp + moe

    @property
    def total_params(self) -> int:
        return self.dense_params + self.expert_params

    # ---- activations (elements a token, one layer, TP 1; the module docstring says what each count is) ----------
    def attention_act(self, recompute: str) -> int:
        h, d, dq, dkv = self.hidden, self.head_dim, self.heads * self.head_dim, self.kv_heads * self.head_dim
        keep = 3 * h + (dq + 2 * dkv) + (dq + dkv) + 2 * dq + 4 * d + ((2 * dq + dkv) if self.qk_norm else 0)
        return keep - (dq if recompute == "selective" else 0)

    def dense_mlp_act(self, recompute: str) -> int:
        return 3 * self.hidden + (0 if recompute == "selective" else 5 * self.ffn)

    def moe_act(self) -> int:
        h = self.hidden
        return 3 * h + 2 * self.experts + self.top_k * (2 * h + 4 * self.moe_ffn) + 5 * self.shared_ffn

    def layer_act(self, moe: bool, recompute: str) -> int:
        mlp = self.moe_act() if moe else self.dense_mlp_act(recompute)
        return self.attention_act(recompute) + mlp


def mla_attention_params(mla: dict, hidden: int, heads: int) -> int:
    """One multi-latent attention layer's parameters (attention/mla.mla_options' keys): the query's down and up
    projections and latent norm (or one projection without q_lora_rank), the key-value down projection (latent +
    the shared RoPE key) with its norm and up projection (keys and values of every head), the output projection.
    Its activations are counted as a GQA layer's of the same head widths (an approximation)."""
    qk = mla["qk_head_dim"] + mla["qk_pos_emb_head_dim"]
    q_lora, kv_lora, v = mla.get("q_lora_rank"), mla["kv_lora_rank"], mla["v_head_dim"]
    query = hidden * q_lora + q_lora + q_lora * heads * qk if q_lora else hidden * heads * qk
    key_value = hidden * (kv_lora + mla["qk_pos_emb_head_dim"]) + kv_lora + kv_lora * heads * (mla["qk_head_dim"] + v)
    return query + key_value + heads * v * hidden


@dataclass(frozen=True)
class Layout:
    """One trainer layout and the settings memory depends on."""

    world: int                       # trainer ranks (trainer.num_workers)
    tp: int = 1
    ep: int = 1
    micro_batch_tokens: int = 4096   # tokens forwarded per micro-batch (trainer.micro_batch_tokens)
    recompute: str = "none"
    recompute_layers: int | None = None   # full: the first N layers (None: all)
    dtype: str = "bfloat16"
    distributed_optimizer: bool | None = None  # None: on when DP > 1 (trainer.use_distributed_optimizer)
    offload: bool = False            # trainer.optimizer_cpu_offload
    scored_share: float = 1.0        # share of a micro-batch's tokens that are scored (the output layer's rows)
    engine_bytes: int = 0            # what a colocated engine keeps on the device

    @property
    def dp(self) -> int:
        return self.world // self.tp

    @property
    def expert_dp(self) -> int:
        return self.world // self.ep

    @property
    def distributed(self) -> bool:
        if self.offload:
            return True
        return self.dp > 1 if self.distributed_optimizer is None else self.distributed_optimizer

    def describe(self) -> str:
        layers = f" ({self.recompute_layers} layers)" if self.recompute == "full" and self.recompute_layers else ""
        return (f"TP {self.tp} x EP {self.ep} (DP {self.dp}), recompute {self.recompute}{layers}, "
                f"micro_batch_tokens {self.micro_batch_tokens}" + (", optimizer offload" if self.offload else ""))


@dataclass
class MemoryTerms:
    """Bytes per term on one trainer rank (see the module docstring); `host` is what offload puts in host memory."""

    terms: dict[str, int]
    host: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    def largest(self) -> tuple[str, int]:
        return max(self.terms.items(), key=lambda kv: kv[1])

    def table(self) -> str:
        rows = [f"  {k:<12} {v / GIB:9.2f} GiB" for k, v in self.terms.items()]
        rows.append(f"  {'total':<12} {self.total / GIB:9.2f} GiB")
        if self.host:
            rows.append(f"  (host memory: {self.host / GIB:.2f} GiB of offloaded optimizer state)")
        return "\n".join(rows)


def rank_params(shape: MemoryShape, layout: Layout) -> tuple[int, int]:
    """(dense, expert) parameters one rank holds: dense split over TP (norms and routers replicated), experts over
    EP."""
    h = shape.hidden
    replicated = h + shape.layers * (2 * h + (2 * shape.head_dim if shape.qk_norm else 0)) + \
        shape.moe_layers * shape.experts * h
    dense = (shape.dense_params - replicated) // layout.tp + replicated
    return dense, shape.expert_params // layout.ep


def activation_bytes(shape: MemoryShape, layout: Layout) -> int:
    """One micro-batch's activations kept from its forward to its backward, all layers and the final norm (see the
    module docstring), on one rank: tokens split over TP (sequence parallelism)."""
    b = DTYPE_BYTES[layout.dtype]
    tokens = -(-layout.micro_batch_tokens // layout.tp)
    per_token = sum(shape.hidden if i < recomputed_layers(shape, layout) else shape.layer_act(moe, layout.recompute)
                    for i, moe in enumerate(moe_layer_flags(shape)))
    return int(b * tokens * (per_token + 2 * shape.hidden))


def moe_layer_flags(shape: MemoryShape) -> list[bool]:
    """Which layers have experts (only their count matters to the model)."""
    return [i >= shape.layers - shape.moe_layers for i in range(shape.layers)]


def recomputed_layers(shape: MemoryShape, layout: Layout) -> int:
    if layout.recompute != "full":
        return 0
    return shape.layers if layout.recompute_layers is None else min(layout.recompute_layers, shape.layers)


def backward_bytes(shape: MemoryShape, layout: Layout) -> int:
    """What the layers' backward holds beyond the kept activations: the working set of one layer's backward
    (BACKWARD_LAYERS of its activations) and, under full recompute, that layer's activations made again. The
    head's backward runs first and frees the logits, so only what exceeds them raises the peak."""
    b = DTYPE_BYTES[layout.dtype]
    tokens = -(-layout.micro_batch_tokens // layout.tp)
    live = max(shape.layer_act(m, "none") for m in set(moe_layer_flags(shape)))
    layers = BACKWARD_LAYERS + (1 if recomputed_layers(shape, layout) else 0)
    return max(0, int(b * tokens * live * layers) - logits_bytes(shape, layout))


def logits_bytes(shape: MemoryShape, layout: Layout) -> int:
    """The output layer's fp32 logits kept for the backward: the scored tokens' rows at TP 1 (trainer/
    logprob_head.py); under sequence parallelism every position's rows of the rank's vocabulary share
    (trainer/logprobs.py: not chunked there)."""
    if layout.tp == 1:
        rows = int(layout.micro_batch_tokens * layout.scored_share)
        return 4 * rows * shape.vocab
    return 4 * layout.micro_batch_tokens * -(-shape.vocab // layout.tp)


def rank_memory(shape: MemoryShape, layout: Layout) -> MemoryTerms:
    """Every term on one trainer rank, bytes."""
    if layout.recompute not in RECOMPUTE:
        raise ValueError(f"recompute {layout.recompute!r}; valid: {', '.join(RECOMPUTE)}")
    if layout.world % layout.tp or layout.world % layout.ep:
        raise ValueError(f"tp {layout.tp} and ep {layout.ep} must divide the {layout.world} trainer ranks")
    b = DTYPE_BYTES[layout.dtype]
    dense, experts = rank_params(shape, layout)
    held = dense + experts
    shard = (dense / layout.dp + experts / layout.expert_dp) if layout.distributed else held
    main = 0 if layout.dtype == "float32" else int(4 * shard)
    optim = int(8 * shard)
    host = 0
    if layout.offload:
        host, main, optim = main + optim, 0, 0
    act, logits = activation_bytes(shape, layout), logits_bytes(shape, layout)
    # a colocated engine sleeps while the trainer trains and generates while the trainer holds its state only:
    # the device's peak is state + max(step, engine)
    terms = {"weights": b * held, "main_params": main, "grads": 4 * held, "optimizer": optim,
             "activations": act, "logits": logits, "backward": backward_bytes(shape, layout)}
    terms["engine"] = max(0, layout.engine_bytes - act - logits - terms["backward"])
    return MemoryTerms(terms=terms, host=host)


# ---- the plan: the cheapest layouts that fit -----------------------------------------------------------------------
# The share of a device the terms may fill: the CUDA context, NCCL's buffers and the caching allocator's
# fragmentation are not among them
USABLE_SHARE = 0.9
PEAK_FLOPS = 989e12  # H100 SXM bf16 dense, the scale model's (bench/scale.py)
MFU = 0.4


def active_matrix_params(shape: MemoryShape) -> int:
    """Matrix parameters a token passes through in the layers (attention, the dense or the top-k experts' MLP)."""
    h = shape.hidden
    dense_layers = shape.layers - shape.moe_layers
    attn = shape.dense_layer_params - 2 * h
    return (shape.layers * attn + dense_layers * 3 * h * shape.ffn
            + shape.moe_layers * 3 * h * (shape.top_k * shape.moe_ffn + shape.shared_ffn))


def step_seconds(shape: MemoryShape, layout: Layout, batch_tokens: int, attention_pairs: float = 0.0) -> float:
    """The scale model's step time (bench/scale.py: fwd + bwd = 3 x forward; forward = 2 x active matrix
    parameters a token + 4 d per query-key pair and layer; split over the world's ranks, TP included, at
    PEAK_FLOPS x MFU), plus one more forward for recomputed layers (full) or a third of one (selective: the
    attention and dense MLPs are most of a layer's FLOPs, their recompute is one forward of those)."""
    fwd = 2 * active_matrix_params(shape) * batch_tokens + 4 * shape.layers * shape.heads * shape.head_dim * \
        attention_pairs
    passes = 3.0
    if layout.recompute == "full":
        share = 1.0 if layout.recompute_layers is None else min(layout.recompute_layers, shape.layers) / shape.layers
        passes += share
    elif layout.recompute == "selective":
        passes += 1 / 3
    return passes * fwd / layout.world / (PEAK_FLOPS * MFU)


def candidate_layouts(shape: MemoryShape, base: Layout, world: int, min_tokens: int = 1) -> list[Layout]:
    """Layouts over `world` ranks the trainer can build: TP dividing the heads, kv heads and ranks, EP dividing
    the experts and the ranks, each recompute, micro_batch_tokens halved down to an eighth of the configured but
    never below `min_tokens` (rollout.max_model_len: one sequence is never split over micro-batches), optimizer
    offload in bf16."""
    out = []
    tps = [t for t in (1, 2, 4, 8) if world % t == 0 and shape.kv_heads % t == 0 and shape.heads % t == 0]
    eps = [e for e in (1, 2, 4, 8, 16, 32, 64, 128, 256) if world % e == 0
           and (shape.experts % e == 0 if shape.experts else e == 1)]
    tokens = [base.micro_batch_tokens // 2 ** k for k in range(4) if base.micro_batch_tokens // 2 ** k >= min_tokens]
    tokens = tokens or [base.micro_batch_tokens]
    for tp in tps:
        for ep in eps:
            for recompute in RECOMPUTE:
                for mbt in tokens:
                    for offload in ((False, True) if base.offload or base.dtype != "float32" else (False,)):
                        out.append(replace(base, world=world, tp=tp, ep=ep, recompute=recompute,
                                           micro_batch_tokens=mbt, offload=offload,
                                           distributed_optimizer=None if base.distributed_optimizer is None
                                           else base.distributed_optimizer or offload))
    return out


def layout_cost(shape: MemoryShape, layout: Layout, batch_tokens: int, attention_pairs: float = 0.0) -> tuple:
    """What "cheapest" means: the predicted step seconds, then (for equal seconds) fewer micro-batches, no offload
    (its host copies and CPU step are not in the step time), less TP (its collectives are not either)."""
    return (round(step_seconds(shape, layout, batch_tokens, attention_pairs), 6), layout.offload, layout.tp,
            -layout.micro_batch_tokens, layout.ep)


def fitting_layouts(shape: MemoryShape, base: Layout, world: int, device_bytes: int, batch_tokens: int,
                    limit: int = 5, min_tokens: int = 1, attention_pairs: float = 0.0
                    ) -> list[tuple[Layout, MemoryTerms]]:
    """The cheapest `limit` layouts over `world` ranks whose rank memory fits USABLE_SHARE of `device_bytes`
    (layout_cost)."""
    fits = []
    for layout in candidate_layouts(shape, base, world, min_tokens):
        terms = rank_memory(shape, layout)
        if terms.total <= USABLE_SHARE * device_bytes:
            fits.append((layout, terms))
    fits.sort(key=lambda lt: layout_cost(shape, lt[0], batch_tokens, attention_pairs))
    return fits[:limit]
