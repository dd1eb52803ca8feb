"""The memory model of one trainer rank, term by term, before anything is built (`gspo-ray plan`, the preflight).

    shape = MemoryShape.from_hf_config(read_hf_config(model_dir))        # through model_spec / the family registry
    terms = rank_memory(shape, Layout(world=8, tp=2, ep=4, micro_batch_tokens=32768, dtype="bfloat16"))
    terms.total, terms.largest()                                          # bytes; ("activations", 41.2e9)

Terms (bytes on one rank's device; `Layout` says the parallel layout and the trainer's settings; with pipeline
parallelism those of the busiest stage):

  weights      every parameter this rank holds in the training dtype: its stage's layers (all without PP; the first
               stage also the word embeddings, the last the final norm and the output layer, tied embeddings on
               both), dense ones split over TP (norms and routers replicated), experts over EP (expert-TP 1, as
               the trainer builds them); not split by CP
  main_params  bf16 training: Megatron's fp32 main copy of the weights (none in fp32, where the weights are the
               main copy); with the distributed optimizer split over DP x CP for dense parameters (megatron-core
               0.16.1 shards it over the data-and-context-parallel group) and over the expert-data-parallel group
               (world / (ep x pp) ranks) for experts; with optimizer_cpu_offload in host memory (0 here)
  grads        the gradient buffer: fp32 (grad_reduce_in_fp32 in bf16, and fp32 training), one per parameter held
               (the distributed optimizer reduce-scatters into it; the buffer is whole)
  optimizer    Adam's two fp32 moments, split and offloaded as main_params
  activations  one micro-batch of `micro_batch_tokens` tokens kept from forward to backward, the stage's layers,
               split over TP (sequence parallelism) and CP (each sequence's columns, zig-zag): the elements a token
               and layer that the local layers save (below), experts' top-k copies for MoE layers, fewer with
               recompute; under PP x the micro-batches 1F1B keeps in flight on the stage (min(pp - stage,
               micro-batches): the first stage the most); under CP also the keys and values all-gathered over
               the CP ranks (2 x tokens x kv heads x head dim a layer: one layer's live while it runs, and kept
               by each layer outside full recompute, an upper bound: a selectively recomputed attention call keeps
               them as its checkpoint's inputs, an attention not recomputed as what its SDPA calls saved)
  logits       the output layer's fp32 [tokens scored, vocab / tp] buffer kept for the backward (logprob_head), the
               rank's CP columns, on the last stage
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
    """One trainer layout and the settings memory depends on. world = PP x DP x CP x TP (Megatron's order);
    experts over EP with expert-TP 1, the expert-data-parallel group world / (EP x PP) (CP folds into it)."""

    world: int                       # trainer ranks (trainer.num_workers)
    tp: int = 1
    ep: int = 1
    micro_batch_tokens: int = 4096   # tokens forwarded per micro-batch (trainer.micro_batch_tokens)
    recompute: str = "none"
    recompute_layers: int | None = None   # full: the first N layers of each stage (None: all)
    dtype: str = "bfloat16"
    distributed_optimizer: bool | None = None  # None: on when DP x CP > 1 (trainer.use_distributed_optimizer)
    offload: bool = False            # trainer.optimizer_cpu_offload
    scored_share: float = 1.0        # share of a micro-batch's tokens that are scored (the output layer's rows)
    engine_bytes: int = 0            # what a colocated engine keeps on the device
    cp: int = 1                      # context parallel (trainer.cp): each sequence's tokens over cp ranks
    pp: int = 1                      # pipeline parallel (trainer.pp): the layers in pp stages, 1F1B
    microbatches: int | None = None  # micro-batches a DP rank runs a step (1F1B's in-flight bound; None: >= pp)
    grads_fp32: bool = True          # trainer.grad_reduce_in_fp32: a bf16 model's gradient buffer in fp32

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp * self.pp)

    @property
    def expert_dp(self) -> int:
        return self.world // (self.ep * self.pp)

    @property
    def distributed(self) -> bool:
        if self.offload:
            return True
        return self.dp * self.cp > 1 if self.distributed_optimizer is None else self.distributed_optimizer

    def describe(self) -> str:
        """E.g. "TP 4 x EP 8 x CP 2 (DP 1), recompute none, micro_batch_tokens 33024": CP and PP named when > 1."""
        layers = f" ({self.recompute_layers} layers)" if self.recompute == "full" and self.recompute_layers else ""
        extra = "".join(f" x {name} {n}" for name, n in (("CP", self.cp), ("PP", self.pp)) if n > 1)
        return (f"TP {self.tp} x EP {self.ep}{extra} (DP {self.dp}), recompute {self.recompute}{layers}, "
                f"micro_batch_tokens {self.micro_batch_tokens}" + (", optimizer offload" if self.offload else "")
                + (", bf16 gradient buffers (grad_reduce_in_fp32 false)" if self.bf16_grads else ""))

    @property
    def bf16_grads(self) -> bool:
        """Whether the gradient buffer is in the (bf16) training dtype: grad_reduce_in_fp32 false, not in fp32."""
        return not self.grads_fp32 and self.dtype != "float32"


@dataclass
class MemoryTerms:
    """Bytes per term on one trainer rank (see the module docstring); `host` is what offload puts in host memory;
    `stage` the pipeline stage these are of (the busiest; 0 without PP)."""

    terms: dict[str, int]
    host: int = 0
    notes: list[str] = field(default_factory=list)
    stage: int = 0

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


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its layers [first_layer, first_layer + layers) and whether it is the first (word
    embeddings) or the last (final norm, output layer, logits)."""

    index: int
    first_layer: int
    layers: int
    first: bool
    last: bool


def stage_layer_range(num_layers: int, pp: int, stage: int) -> range:
    """The global layer indices pipeline stage `stage` of `pp` holds: Megatron's even split, [s n / pp,
    (s + 1) n / pp). pp must divide the layers (ValueError otherwise): uneven stages are not built (the config's
    preflight, the planner and trainer/model.stage_layers all read this)."""
    if pp < 1 or num_layers % pp:
        raise ValueError(f"trainer.pp ({pp}) must divide the model's {num_layers} layers")
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per)


def pipeline_stages(num_layers: int, pp: int) -> list[Stage]:
    """The layers over pp stages (stage_layer_range: pp divides them, each stage n / pp)."""
    stages = [stage_layer_range(num_layers, pp, s) for s in range(pp)]
    return [Stage(s, r.start, len(r), s == 0, s == pp - 1) for s, r in enumerate(stages)]


def stage_layer_counts(shape: MemoryShape, stage: Stage, recompute_layers: int) -> tuple[int, int, int, int]:
    """(dense layers, MoE layers, of them recomputed dense, recomputed MoE) of a stage: MoE layers are the model's
    last `moe_layers` (moe_layer_flags), recompute full takes each stage's first `recompute_layers`."""
    a, b = stage.first_layer, stage.first_layer + stage.layers
    moe_from = shape.layers - shape.moe_layers

    def moe_in(lo, hi):
        return max(0, hi - max(lo, moe_from))

    r = min(recompute_layers, stage.layers)
    moe, moe_r = moe_in(a, b), moe_in(a, a + r)
    return stage.layers - moe, moe, r - moe_r, moe_r


def whole_model(shape: MemoryShape) -> Stage:
    return Stage(0, 0, shape.layers, True, True)


def rank_params(shape: MemoryShape, layout: Layout, stage: Stage | None = None) -> tuple[int, int]:
    """(dense, expert) parameters one rank of `stage` (default: the whole model, PP 1) holds: dense split over TP
    (norms and routers replicated), experts over EP. The first stage holds the word embeddings, the last the final
    norm and the output layer (tied embeddings: a copy of the word embeddings, as Megatron keeps on the last
    stage)."""
    stage = stage or whole_model(shape)
    h = shape.hidden
    dense_layers, moe_layers, _, _ = stage_layer_counts(shape, stage, 0)
    norms = 2 * h + (2 * shape.head_dim if shape.qk_norm else 0)
    split = (stage.layers * (shape.dense_layer_params - norms) + dense_layers * 3 * h * shape.ffn
             + moe_layers * 3 * h * shape.shared_ffn)
    embeddings = 1 if shape.tied and stage.first and stage.last else int(stage.first) + int(stage.last)
    split += shape.vocab * h * embeddings
    replicated = (h if stage.last else 0) + stage.layers * norms + moe_layers * shape.experts * h
    experts = moe_layers * shape.experts * 3 * h * shape.moe_ffn
    return split // layout.tp + replicated, experts // layout.ep


def local_tokens(layout: Layout) -> int:
    """Tokens of one micro-batch on one rank: split over CP (each sequence's columns) and TP (sequence
    parallelism)."""
    return -(-layout.micro_batch_tokens // (layout.tp * layout.cp))


def in_flight(layout: Layout, stage: Stage) -> int:
    """Micro-batches whose activations a stage keeps at once under 1F1B (Megatron's
    forward_backward_pipelining_without_interleaving): stage s runs pp - s - 1 warm-up forwards and one more before
    its first backward, so min(pp - s, micro-batches); 1 without PP."""
    m = layout.microbatches if layout.microbatches is not None else layout.pp
    return max(1, min(layout.pp - stage.index, m))


def gathered_kv_bytes(shape: MemoryShape, layout: Layout) -> int:
    """One layer's keys and values all-gathered over CP (the whole micro-batch's columns, the rank's kv heads of
    TP): 2 x tokens x kv heads x head dim x the dtype; 0 without CP."""
    if layout.cp == 1:
        return 0
    heads = -(-shape.kv_heads // layout.tp)
    return 2 * layout.micro_batch_tokens * heads * shape.head_dim * DTYPE_BYTES[layout.dtype]


def activation_bytes(shape: MemoryShape, layout: Layout, stage: Stage | None = None) -> int:
    """The activations one rank of `stage` (default: the whole model) keeps from forward to backward: its layers'
    elements a token (the module docstring) x its tokens (local_tokens: / TP / CP) x the micro-batches in flight
    (in_flight: 1F1B), the final norm on the last stage. Under CP each layer outside full recompute also keeps
    the gathered keys and values (gathered_kv_bytes): as what its SDPA calls saved (an upper bound: a completion
    call with a prefix keeps none), or, with selective recompute of core_attn, as the inputs of the checkpointed
    attention call (the gather runs outside it); a fully recomputed layer keeps its input only and gathers again
    in the backward. One layer's gather is live while it runs."""
    stage = stage or whole_model(shape)
    b = DTYPE_BYTES[layout.dtype]
    dense, moe, dense_r, moe_r = stage_layer_counts(shape, stage, recomputed_layers(shape, layout))
    recompute = layout.recompute
    per_token = ((dense - dense_r) * shape.layer_act(False, recompute) + (moe - moe_r) * shape.layer_act(True, recompute)
                 + (dense_r + moe_r) * shape.hidden + (2 * shape.hidden if stage.last else 0))
    attention_kept = stage.layers - dense_r - moe_r  # layers outside full recompute (dense_r, moe_r: 0 otherwise)
    gathered = gathered_kv_bytes(shape, layout)
    return int(b * local_tokens(layout) * per_token + gathered * attention_kept) * in_flight(layout, stage) + gathered


def moe_layer_flags(shape: MemoryShape) -> list[bool]:
    """Which layers have experts (only their count matters to the model)."""
    return [i >= shape.layers - shape.moe_layers for i in range(shape.layers)]


def recomputed_layers(shape: MemoryShape, layout: Layout) -> int:
    """Layers full recompute checkpoints in each stage (all without PP): trainer.recompute_num_layers or all."""
    if layout.recompute != "full":
        return 0
    return shape.layers if layout.recompute_layers is None else min(layout.recompute_layers, shape.layers)


def backward_bytes(shape: MemoryShape, layout: Layout, stage: Stage | None = None) -> int:
    """What the layers' backward holds beyond the kept activations: the working set of one layer's backward
    (BACKWARD_LAYERS of its activations) and, under full recompute, that layer's activations made again. The
    head's backward (last stage) runs first and frees the logits, so there only what exceeds them raises the
    peak."""
    stage = stage or whole_model(shape)
    b = DTYPE_BYTES[layout.dtype]
    dense, moe, _, _ = stage_layer_counts(shape, stage, 0)
    if not stage.layers:
        return 0
    live = max(shape.layer_act(m, "none") for m, n in ((False, dense), (True, moe)) if n)
    layers = BACKWARD_LAYERS + (1 if recomputed_layers(shape, layout) else 0)
    freed = logits_bytes(shape, layout, stage)
    return max(0, int(b * local_tokens(layout) * live * layers) - freed)


def logits_bytes(shape: MemoryShape, layout: Layout, stage: Stage | None = None) -> int:
    """The output layer's fp32 logits kept for the backward (the last stage only): the scored tokens' rows at TP 1
    (trainer/logprob_head.py); under sequence parallelism every position's rows of the rank's vocabulary share
    (trainer/logprobs.py: not chunked there); under CP the rank's own columns."""
    if stage is not None and not stage.last:
        return 0
    tokens = -(-layout.micro_batch_tokens // layout.cp)
    if layout.tp == 1:
        return 4 * int(tokens * layout.scored_share) * shape.vocab
    return 4 * tokens * -(-shape.vocab // layout.tp)


def check_layout(shape: MemoryShape, layout: Layout) -> None:
    """ValueError for a layout the trainer cannot build: TP x CP x PP and EP x PP must divide the ranks (expert-TP
    1), PP the layers (stage_layer_range), recompute one of RECOMPUTE."""
    if layout.recompute not in RECOMPUTE:
        raise ValueError(f"recompute {layout.recompute!r}; valid: {', '.join(RECOMPUTE)}")
    if layout.world % (layout.tp * layout.cp * layout.pp) or layout.world % (layout.ep * layout.pp):
        raise ValueError(f"tp {layout.tp} x cp {layout.cp} x pp {layout.pp} and ep {layout.ep} x pp {layout.pp} "
                         f"must divide the {layout.world} trainer ranks")
    if shape.layers % layout.pp:
        raise ValueError(f"pp {layout.pp} does not divide the model's {shape.layers} layers")


def stage_memory(shape: MemoryShape, layout: Layout, stage: Stage) -> MemoryTerms:
    """Every term on one rank of `stage`, bytes. The distributed optimizer shards the dense state over the DP x CP
    group (megatron-core 0.16.1: the grad buffers' dp_cp group, parallel_state.get_data_parallel_group(
    with_context_parallel=True)) and the experts' over the expert-data-parallel group (world / (EP x PP))."""
    b = DTYPE_BYTES[layout.dtype]
    dense, experts = rank_params(shape, layout, stage)
    held = dense + experts
    shard = (dense / (layout.dp * layout.cp) + experts / layout.expert_dp) if layout.distributed else held
    main = 0 if layout.dtype == "float32" else int(4 * shard)
    optim = int(8 * shard)
    host = 0
    if layout.offload:
        host, main, optim = main + optim, 0, 0
    act, logits = activation_bytes(shape, layout, stage), logits_bytes(shape, layout, stage)
    # a colocated engine sleeps while the trainer trains and generates while the trainer holds its state only:
    # the device's peak is state + max(step, engine)
    terms = {"weights": b * held, "main_params": main, "grads": (b if layout.bf16_grads else 4) * held, "optimizer": optim,
             "activations": act, "logits": logits, "backward": backward_bytes(shape, layout, stage)}
    terms["engine"] = max(0, layout.engine_bytes - act - logits - terms["backward"])
    return MemoryTerms(terms=terms, host=host, stage=stage.index)


def rank_memory(shape: MemoryShape, layout: Layout) -> MemoryTerms:
    """Every term on the busiest rank, bytes: without PP the one rank shape; with PP the stage whose total is
    largest, the first (the most micro-batches in flight and the embeddings) or the last (the output layer and
    the logits): the stages hold as many layers each, and an inner one fewer in flight than the first."""
    check_layout(shape, layout)
    stages = pipeline_stages(shape.layers, layout.pp)
    return max((stage_memory(shape, layout, s) for s in dict.fromkeys((stages[0], stages[-1]))),
               key=lambda t: t.total)
