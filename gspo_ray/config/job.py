"""One job = one YAML file: the sections together and the checks that span sections."""
from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from gspo_ray.config.autoscale import autoscale_problem
from gspo_ray.config.base import Strict, RUN_NAME, GUESS_ENV
from gspo_ray.config.model import TinyModelConfig, ModelConfig
from gspo_ray.config.data import DataConfig, missing_path_message
from gspo_ray.config.rollout import RolloutConfig, colocation_problem, gpu_colocated
from gspo_ray.config.trainer import TrainerConfig
from gspo_ray.config.lora import merged_bf16_problem
from gspo_ray.config.algorithm import AlgorithmConfig
from gspo_ray.config.coordinator import CoordinatorConfig, ClusterConfig
from gspo_ray.config.tracking import LoggingConfig


AUTO_DTYPE_ENV = "GSPO_RAY_AUTO_DTYPE"  # pins `dtype: auto` at load (float32 | bfloat16), whatever the host


class JobConfig(Strict):
    """One training job."""

    name: str = Field("gspo", description="run name; the run directory is out_dir/name")
    seed: int = Field(0, description="the job's seed: the engines' sampling (unless rollout.seed is set), the "
                      "buffer's mini-batch shuffles, the push-probe sequences. The prompt order and held-out split "
                      "are seeded by data.seed and a tiny model's init by model.tiny.seed, so runs that differ by "
                      "seed train and evaluate on the same prompts")
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
    def _seed_the_engines(self) -> "JobConfig":
        if self.rollout.seed is None:  # `seed=1` alone must change the samples, or "seeds" repeat one run
            self.rollout.seed = self.seed
        return self

    @model_validator(mode="after")
    def _pinned_auto_dtype(self) -> "JobConfig":
        """GSPO_RAY_AUTO_DTYPE=float32|bfloat16 resolves `dtype: auto` here, at load, whatever the host (the test
        suite pins float32, tests/conftest.py); unset, auto is resolved by the device at job start
        (models/native_bf16.py)."""
        pinned = os.environ.get(AUTO_DTYPE_ENV)
        if not pinned:
            return self
        if pinned not in ("float32", "bfloat16"):
            raise ValueError(f"{AUTO_DTYPE_ENV}={pinned!r} in the environment; valid: float32, bfloat16 (or unset)")
        for pool in (self.rollout, self.trainer):
            if pool.dtype == "auto":
                pool.dtype = pinned
        return self

    @model_validator(mode="after")
    def _cross(self) -> "JobConfig":
        tiny = self.model.tiny
        if tiny is not None and tiny.is_moe:
            if tiny.top_k > tiny.experts:
                raise ValueError(f"model.tiny.top_k ({tiny.top_k}) > model.tiny.experts ({tiny.experts})")
            if tiny.experts % self.trainer.ep:
                raise ValueError(f"trainer.ep ({self.trainer.ep}) must divide model.tiny.experts ({tiny.experts})")
        if self.model.path is not None and not (self.model.path / "config.json").exists():
            raise ValueError(f"model.path: no config.json in {self.model.path}")
        for name in ("path", "eval_path"):
            p = getattr(self.data, name)
            if p is not None and not Path(p).exists():
                raise ValueError(f"data.{name}: {missing_path_message(p)}")
        if self.rollout.agent is not None and self.data.apply_chat_template:
            raise ValueError("data.apply_chat_template with rollout.agent: the agent's messages are rendered by the "
                             "endpoint's chat template; set data.apply_chat_template false (task['prompt'] is the "
                             "row's prompt text)")
        partial = self.rollout.partial
        if partial is not None:
            default_staleness = type(self.coordinator).model_fields["max_staleness"].default
            if self.coordinator.max_staleness != default_staleness:  # would be silently ignored
                raise ValueError(f"coordinator.max_staleness ({self.coordinator.max_staleness}) is not used with "
                                 "rollout.partial: partial rollouts bound staleness per token with "
                                 "rollout.partial.max_staleness (counted in policy versions = optimizer steps; a "
                                 "train step is coordinator.num_iterations x num_minibatches of them). Set that and "
                                 f"leave coordinator.max_staleness at {default_staleness}")
            if partial.stale_policy == "keep":
                self._check_partial_keep(partial)
            agent = self.rollout.agent
            if agent is not None and partial.segment_tokens >= agent.max_total_tokens:
                raise ValueError(f"rollout.partial.segment_tokens ({partial.segment_tokens}) must be below "
                                 f"rollout.agent.max_total_tokens ({agent.max_total_tokens}), else no agent episode "
                                 "is ever continued across rounds")
            native = self.rollout.multi_turn  # EpisodeRunner: turn and episode limits, not rollout.max_new_tokens
            if agent is None and native is not None and partial.segment_tokens >= native.max_total_tokens:
                raise ValueError(f"rollout.partial.segment_tokens ({partial.segment_tokens}) must be below "
                                 f"rollout.multi_turn.max_total_tokens ({native.max_total_tokens}), else no "
                                 "multi-turn episode is ever continued across rounds")
            if agent is None and native is None and partial.segment_tokens >= self.rollout.max_new_tokens:
                raise ValueError(f"rollout.partial.segment_tokens ({partial.segment_tokens}) must be below "
                                 f"rollout.max_new_tokens ({self.rollout.max_new_tokens}), else no completion is "
                                 "ever cut")
        if self.rollout.max_new_tokens >= self.rollout.max_model_len:
            raise ValueError(f"rollout.max_new_tokens ({self.rollout.max_new_tokens}) leaves no room for a prompt "
                             f"in rollout.max_model_len ({self.rollout.max_model_len})")
        return self

    def _check_partial_keep(self, partial) -> None:
        """`stale_policy: keep` trains tokens of any age, which is sound only while each token's ratio is anchored
        on the engine log-prob of the policy that sampled it: an old token's ratio then moves away from 1 and the
        clip band stops its gradient, so age costs signal, not correctness. A recomputed anchor is the trainer's
        current policy, under which a stale token reads as on-policy; a mismatch correction (rho = pi_old /
        pi_engine over each token's own sampling log-prob) restores the link."""
        if "max_staleness" in partial.model_fields_set:  # would be silently ignored
            raise ValueError(f"rollout.partial.max_staleness ({partial.max_staleness}) is not used with "
                             "rollout.partial.stale_policy 'keep' (tokens of any age train, anchored on their own "
                             "sampling log-probs): set stale_policy 'mask' or 'drop' to bound their age")
        if self.coordinator.recompute_old_logprobs and self.algorithm.mismatch_correction.level == "none":
            raise ValueError("rollout.partial.stale_policy 'keep' with coordinator.recompute_old_logprobs: true "
                             "trains tokens sampled several policy versions ago as if the current policy had "
                             "sampled them (the recomputed anchor hides their age from the clip band): set "
                             "algorithm.mismatch_correction (it weighs each token by pi_old / pi_engine of its own "
                             "sampling policy) or rollout.partial.stale_policy 'mask' or 'drop'")

    @model_validator(mode="after")
    def _micro_batch_holds_a_row(self) -> "JobConfig":
        """A micro-batch must hold the longest row a rollout can give (prompt + completion, at most the engine's
        max_model_len); a shared-prefix group row is never shorter than its longest member."""
        cap, longest = self.trainer.micro_batch_tokens, self.rollout.max_model_len
        if cap is not None and cap < longest:
            raise ValueError(f"trainer.micro_batch_tokens ({cap}) is smaller than the longest row a rollout can give, "
                             f"rollout.max_model_len ({longest}): raise micro_batch_tokens to at least {longest} "
                             "or lower max_model_len")
        return self

    @model_validator(mode="after")
    def _algorithm_needs(self) -> "JobConfig":
        """Algorithm options that need a coordinator setting."""
        c, a = self.coordinator, self.algorithm
        if a.mismatch_correction.level != "none" and not c.recompute_old_logprobs:
            raise ValueError("algorithm.mismatch_correction needs coordinator.recompute_old_logprobs: true (the "
                             "engine's log-probs are the anchor otherwise, so there is no gap to correct)")
        # bf16 with the engine's log-probs as the anchor is not refused here: the job measures their gap to the
        # trainer's at its first step (and every coordinator.anchor_gap_every) and stops where it does not fit the
        # band (algo/anchor_gap.py; measured bf16/bf16 on SmolLM2: 0.048 per token, 0.011-0.013 per sequence)
        lora = self.trainer.lora
        if lora is not None and lora.serve == "merged":  # an MoE on CPU engines is checked by the preflight
            problem = merged_bf16_problem({"trainer.dtype": self.trainer.dtype, "rollout.dtype": self.rollout.dtype},
                                          a.mismatch_correction.level)
            if problem:
                raise ValueError(f"trainer.lora.serve merged: {problem}")
        one_pass = c.num_iterations * c.num_minibatches == 1
        if a.eps == "auto" and one_pass and (c.mode == "sync" or c.recompute_old_logprobs):
            # auto measures drift on mini-batches trained after the anchor's version. With one pass x one
            # mini-batch the only mini-batch is the anchor's own when the anchor is the sampling policy in sync
            # mode, and always when the trainer recomputes it (the ratio is then 1 up to recompute noise)
            anchor = ("the trainer recomputes the old log-probs, so the ratio is 1" if c.recompute_old_logprobs
                      else "sync mode trains each batch on the policy that sampled it")
            raise ValueError(f"algorithm.eps 'auto' measures drift on reuse mini-batches, and with one pass x one "
                             f"mini-batch {anchor}: set coordinator.num_iterations or num_minibatches above 1, or "
                             "a fixed algorithm.eps" + ("" if c.recompute_old_logprobs else " (or mode async)"))
        if c.mode == "async" and c.recompute_old_logprobs and a.mismatch_correction.level == "none":
            # the recomputed anchor is the trainer's current policy, one update newer than the one that sampled:
            # the ratio no longer sees that staleness, and only the engine-vs-trainer correction weighs it
            raise ValueError("coordinator.mode async with coordinator.recompute_old_logprobs needs "
                             "algorithm.mismatch_correction (token, sequence or geometric): the ratio then anchors "
                             "on the trainer's current policy, so the samples' one-update staleness is corrected by "
                             "nothing else")
        return self

    @model_validator(mode="after")
    def _replay_records_the_sampling_policy(self) -> "JobConfig":
        """R2 (and the routing-noise probe, which holds R2's records) record routing on a batch's first trainer
        forward. That forward runs the sampling policy only in sync mode with whole rollouts: in async mode the
        batch was sampled one update earlier, and a partial rollout's tokens come from several policies, so what
        they would hold is not the routing that produced them (the probe would read 0, not the routing change
        since sampling). Routing drift stays on there and says how late its first sight is
        (`moe/drift_first_sight_lag`, docs/moe.md)."""
        t = self.trainer
        for field in (["trainer.routing_replay 'R3'"] if t.routing_replay == "R3" else []) + (
                ["trainer.routing_agreement"] if t.routing_agreement else []):
            tiny = self.model.tiny
            if tiny is not None and not tiny.is_moe:
                raise ValueError(f"{field} needs an MoE model: model.tiny.arch {tiny.arch!r} has no routers (use "
                                 "'qwen3_moe', 'glm4_moe' or 'gpt_oss')")
            if self.rollout.multi_turn is not None:
                raise ValueError(f"{field} cannot be combined with rollout.multi_turn: episodes do not carry the "
                                 "engine's routes")
            if self.rollout.agent is not None:
                raise ValueError(f"{field} cannot be combined with rollout.agent: agent episodes do not carry the "
                                 "engine's routes")
            if self.rollout.tensor_parallel_size > 1:
                # the route capture hooks the in-process engine's runner; a multi-process engine's routers run in
                # its worker processes, out of the hook's reach
                raise ValueError(f"{field} needs rollout.tensor_parallel_size 1 (got "
                                 f"{self.rollout.tensor_parallel_size}): the engine's routes are captured in the "
                                 "in-process engine only")
        # R3 replays the engine's routing, recorded per position when it sampled: any mode, partial rollouts too
        for on, name in ((t.routing_replay == "R2", f"trainer.routing_replay {t.routing_replay!r}"),
                         (t.routing_noise, "trainer.routing_noise")):
            if not on:
                continue
            if self.coordinator.mode == "async":
                raise ValueError(f"{name} needs coordinator.mode 'sync': in async mode the trainer has moved on by "
                                 "one update when a batch arrives, so its first forward (what it records) is not "
                                 "the policy that sampled the batch")
            if self.rollout.partial is not None:
                raise ValueError(f"{name} cannot be combined with rollout.partial: a continued completion's "
                                 "tokens were sampled by several policies, and it records one routing per sequence")
        return self

    @model_validator(mode="after")
    def _colocation_placeable(self) -> "JobConfig":
        """Colocated pools (both num_gpus_per_worker below 1) are placed rank by rank: refused where they cannot
        be (config/rollout.colocation_problem), or where the autoscaler would resize one pool on GPUs the other
        holds."""
        t = self.trainer
        problem = colocation_problem(self.rollout, t.num_workers, t.num_gpus_per_worker, self.coordinator.mode)
        if problem is None and self.coordinator.autoscale is not None and gpu_colocated(
                self.rollout.num_gpus_per_worker, t.num_gpus_per_worker):
            problem = ("coordinator.autoscale with colocated pools (rollout and trainer num_gpus_per_worker below "
                       "1): each engine sits on its trainer ranks' GPUs, so neither pool can be resized alone")
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _autoscale_fits(self) -> "JobConfig":
        """Bounds against each other, the budget, the trainer's layout and the node (config/autoscale.py)."""
        problem = autoscale_problem(self)
        if problem is not None:
            raise ValueError(problem)
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
