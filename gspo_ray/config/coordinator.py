"""The loop (steps, passes, mini-batches, staleness, checkpoints, eval) and the cluster it runs on."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from gspo_ray.config.autoscale import AutoscaleConfig
from gspo_ray.config.base import Strict


class CoordinatorConfig(Strict):
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
    max_refill_rounds: int = Field(4, ge=0, description="extra rollout rounds to refill filtered groups. Every "
                                   "round, the first too, draws missing / (1 - the observed filter rate) prompts "
                                   "(at most 4x missing), so 0 still over-samples")
    recompute_old_logprobs: bool = Field(False, description="recompute old log-probs with the trainer instead of "
                                         "using the engine's (to measure the engine-trainer gap)")
    anchor_gap_every: int = Field(10, ge=0, description="with the engine's log-probs as the anchor: the trainer "
                                  "scores the first mini-batch's samples of the trainer's current version before "
                                  "the step's first update, at the job's first step and every N steps after (0 = "
                                  "the first step only); train/anchor_gap_* logged, and the job stops where the gap "
                                  "does not fit the clip band (gspo_ray/algo/anchor_gap.py). 10: one forward of one "
                                  "mini-batch per 10 steps (under 1% of the train phase) catches a gap that grows as "
                                  "the policy sharpens within 10 steps. Async mode: only step 1's samples are of the "
                                  "trainer's version; later checks usually find none and log only "
                                  "train/anchor_gap_samples 0")
    eval_every: int = Field(5, ge=0, description="held-out evaluation every N steps (0 = only start and end)")
    checkpoint_every: int = Field(10, ge=0, description="save a checkpoint every N steps (0 = only at the end, "
                                  "and whenever checkpoint_every_s passed)")
    checkpoint_every_s: float = Field(600.0, ge=0, description="also save at the first step boundary at least this "
                                      "many seconds after the last save (or the job's first step; 0 = off), so a "
                                      "trainer death or a kill replays at most this long plus one step, whatever "
                                      "checkpoint_every is (smollm2_sum: a save every ~8-15 steps, ~60 s each on 2 "
                                      "cores)")
    keep_checkpoints: int | None = Field(2, ge=1, description="complete checkpoints kept, newest first (None = "
                                         "all; TRL's save_total_limit). 2: the newest plus the one --resume falls "
                                         "back to when the newest is broken, which is never deleted")
    early_stop_reward: float | None = Field(None, description="stop once the held-out metric named by "
                                            "early_stop_metric (default: the mean reward) reaches this")
    early_stop_metric: str = Field("eval/reward", pattern=r"^eval/\S+$",
                                   description="the held-out metric early_stop_reward is compared with: "
                                   "eval/reward, eval/pass@1, or eval/<name> for what the reward returns besides "
                                   "`reward` (e.g. eval/exact); a key the first evaluation does not log is an error")
    autoscale: AutoscaleConfig | None = Field(None, description="set both pools' sizes from measured throughput "
                                              "while the job runs (docs/autoscale.md); None = the sizes stay as "
                                              "configured (`gspo-ray scale` still resizes by hand)")

    @model_validator(mode="after")
    def _check(self) -> "CoordinatorConfig":
        if self.prompts_per_step % self.num_minibatches:
            raise ValueError(f"coordinator.num_minibatches ({self.num_minibatches}) must divide "
                             f"coordinator.prompts_per_step ({self.prompts_per_step}): mini-batches hold whole groups")
        return self


class ClusterConfig(Strict):
    """Where the job runs: a local Ray started in-process, or an existing cluster."""

    address: str | None = Field(None, description="Ray address to join (None = start a local instance)")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local instance (default: all)")
    namespace: str = Field("gspo-ray", description="Ray namespace")
    runtime_env: dict[str, Any] = Field(default_factory=dict, description="Ray runtime_env for workers")
