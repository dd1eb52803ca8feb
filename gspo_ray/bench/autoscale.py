"""`gspo-ray bench --suite autoscale`: the pool-size controller (coordinator/autoscale.py, the job's own) driven by
a model of phase times at cluster shapes, against fixed splits. No Ray, no model: seconds of pure Python.

The model of one step (`Scenario.phases`), per scenario (`SCENARIOS`, docs/autoscale.md states them):
  rollout  each engine holds `kv_tokens` of KV cache, so it decodes min(256, kv_tokens / (prompt + completion))
           sequences at once; a step's completions take waves x length x `decode_s` per token, and the longest
           completion (3x the mean, up to the limit) adds its tail: rollout time grows faster than the completion
           length once the KV cache, not the batch, bounds the engine
  train    (prompt + completion) tokens x completions / (ranks x `train_tok_s`), with `train_eff` per doubling of
           ranks (data-parallel all-reduce, MoE all-to-all)
  sync     a weight push: `push_s` + 10 ms per engine
  costs    a grow of the rollout pool `engine_start_s` (RolloutPool.scale starts its new engines together); a
           trainer resize (save + rebuild + load) `resize_s`
Completion lengths grow `growth`x over the run (geometrically), the drift that makes a step-0 split wrong. The
measured times the controller sees carry +-3% noise (seeded). Fixed splits use every device: trainer ranks in
layout steps of `trainer_step`, the rest rollout engines of `engine_gpus`. "best fixed" is the best of them over
the whole run (hindsight); "step-0" the best for the step-0 workload (what a user measuring a first run would pick);
the autoscaler starts from the step-0 split and pays for every move it makes.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from gspo_ray.bench.common import markdown_table
from gspo_ray.config.autoscale import AutoscaleConfig, PoolBounds
from gspo_ray.coordinator.autoscale import Autoscaler, Pools, StepTimes


@dataclass(frozen=True)
class Scenario:
    name: str
    gpus: int
    mode: str  # sync | async
    engine_gpus: int  # GPUs per rollout engine
    trainer_step: int  # trainer sizes are multiples of this (tp x ep layout)
    kv_tokens: float  # KV-cache tokens per engine
    decode_s: float  # seconds per decode iteration of an engine: reading the weights
    kv_read_s: float  # ... plus this much with its whole KV cache in use (less when the batch does not fill it)
    train_tok_s: float  # trained tokens per second per rank (forward, backward, old log-probs)
    train_eff: float  # scaling efficiency per doubling of trainer ranks
    push_s: float
    engine_start_s: float
    resize_s: float
    length0: int  # mean completion length at step 0
    growth: float = 4.0  # ... times this at the end
    prompt: int = 512
    completions: int = 16384  # per step (1024 prompts x 16)
    max_seqs: int = 1024  # an engine's most sequences at once (vLLM max_num_seqs)
    max_len: int = 32768
    steps: int = 200
    max_move: int = 8
    horizon_steps: int = 20

    def length(self, step: int) -> float:
        return self.length0 * self.growth ** (step / max(self.steps - 1, 1))

    def phases(self, engines: int, ranks: int, step: int) -> tuple[float, float, float]:
        """(rollout, train, sync) seconds of one step at these sizes."""
        n = self.length(step)
        per_engine = min(self.max_seqs, self.kv_tokens / (self.prompt + n))  # sequences decoded at once
        iteration = self.decode_s + self.kv_read_s * min(per_engine * (self.prompt + n) / self.kv_tokens, 1.0)
        waves = max(self.completions / (engines * per_engine), 1.0)
        tail = min(2 * n, self.max_len) - n  # the longest completion: twice the mean
        rollout = iteration * (waves * n + tail)
        tokens = self.completions * (self.prompt + n)
        train = tokens / (ranks * self.train_tok_s) / self.train_eff ** math.log2(max(ranks / self.trainer_step, 1))
        return rollout, train, self.push_s + 0.01 * engines

    def step_s(self, engines: int, ranks: int, step: int) -> float:
        r, t, s = self.phases(engines, ranks, step)
        return r + t + s if self.mode == "sync" else max(r, t + s)

    def splits(self) -> list[tuple[int, int]]:
        """Every fixed split that uses the whole cluster: (engines, trainer ranks)."""
        out = []
        for ranks in range(self.trainer_step, self.gpus, self.trainer_step):
            engines = (self.gpus - ranks) // self.engine_gpus
            if engines >= 1:
                out.append((engines, ranks))
        return out


# an 8B dense model (GQA, 128 KiB of KV a token) on one 80 GiB GPU per engine, trained at 6k tokens/s a GPU;
# a 235B-A22B MoE (fp8 engines of 8 GPUs, 192 KiB a token), trained at 1.5k tokens/s a GPU in layout steps of 8
_DENSE = dict(engine_gpus=1, trainer_step=8, kv_tokens=400_000, decode_s=0.005, kv_read_s=0.015, train_tok_s=6_000,
              train_eff=0.97, push_s=4.0, engine_start_s=45.0, resize_s=120.0)
_MOE = dict(engine_gpus=8, trainer_step=8, kv_tokens=2_100_000, decode_s=0.012, kv_read_s=0.015, train_tok_s=1_500,
            train_eff=0.93, push_s=20.0, engine_start_s=120.0, resize_s=300.0)
SCENARIOS = (
    Scenario("dense-64-sync", gpus=64, mode="sync", length0=1000, **_DENSE),
    Scenario("dense-128-async", gpus=128, mode="async", length0=1000, **_DENSE),
    Scenario("dense-128-async-flat", gpus=128, mode="async", length0=2000, growth=1.0, **_DENSE),
    Scenario("moe-256-sync", gpus=256, mode="sync", length0=1500, **_MOE),
    Scenario("moe-512-async", gpus=512, mode="async", length0=1500, **_MOE),
    Scenario("moe-512-sync-flat", gpus=512, mode="sync", length0=3000, growth=1.0, **_MOE),
)


def fixed_run(sc: Scenario, engines: int, ranks: int) -> float:
    """Completions trained per second over the whole run at one split."""
    return sc.completions * sc.steps / sum(sc.step_s(engines, ranks, i) for i in range(sc.steps))


def step0_split(sc: Scenario) -> tuple[int, int]:
    return min(sc.splits(), key=lambda s: sc.step_s(*s, 0))


def autoscaled_run(sc: Scenario, seed: int = 0) -> tuple[float, int, tuple[int, int]]:
    """The controller from the step-0 split: (completions trained per second with every move's cost paid, moves
    made, the final split)."""
    rng = random.Random(seed)
    cfg = AutoscaleConfig(rollout=PoolBounds(min=1, max=sc.gpus // sc.engine_gpus),
                          trainer=PoolBounds(min=sc.trainer_step, max=sc.gpus - sc.engine_gpus),
                          max_devices=sc.gpus, window_steps=3, cooldown_steps=5, max_move=sc.max_move,
                          give_back=False, horizon_steps=sc.horizon_steps,
                          move_cost_prior_s=sc.engine_start_s)
    pools = Pools(rollout=(cfg.rollout.min, cfg.rollout.max), trainer=(cfg.trainer.min, cfg.trainer.max),
                  rollout_devices=sc.engine_gpus, trainer_devices=1, max_devices=sc.gpus, mode=sc.mode,
                  trainer_problem=lambda n: None if n % sc.trainer_step == 0 else "layout")
    scaler = Autoscaler(cfg, pools)
    engines, ranks = step0_split(sc)
    clock, moves = 0.0, 0
    for step in range(sc.steps):
        clock += sc.step_s(engines, ranks, step)
        r, t, s = (x * (1 + rng.uniform(-0.03, 0.03)) for x in sc.phases(engines, ranks, step))
        scaler.observe(StepTimes(engines, ranks, r, t, s, sc.completions, at_s=clock,
                                 tokens=int(sc.completions * sc.length(step))))
        d = scaler.decide(step + 1, clock, sc.steps - step - 1)
        if d.action == "hold":
            continue
        cost = (sc.engine_start_s if d.rollout_workers > engines else 0.0) + \
            (sc.resize_s if d.trainer_workers != ranks else 0.0)
        clock += cost
        scaler.applied(d, step + 1, clock, cost_s=cost)
        engines, ranks, moves = d.rollout_workers, d.trainer_workers, moves + 1
    return sc.completions * sc.steps / clock, moves, (engines, ranks)


def bench_rows(scenarios=SCENARIOS) -> list[dict]:
    rows = []
    for sc in scenarios:
        best = max(sc.splits(), key=lambda s: fixed_run(sc, *s))
        start = step0_split(sc)
        best_x, start_x = fixed_run(sc, *best), fixed_run(sc, *start)
        auto_x, moves, final = autoscaled_run(sc)
        rows.append({"scenario": sc.name, "best fixed (engines/ranks)": f"{best[0]}/{best[1]}",
                     "best fixed c/s": best_x, "step-0 (engines/ranks)": f"{start[0]}/{start[1]}",
                     "step-0 c/s": start_x, "autoscaler c/s": auto_x,
                     "auto / best": auto_x / best_x, "auto / step-0": auto_x / start_x, "moves": moves,
                     "final (engines/ranks)": f"{final[0]}/{final[1]}"})
    return rows


def run_autoscale_bench() -> list[dict]:
    rows = bench_rows()
    print("completions trained per second over the run (c/s), every move's cost paid by the autoscaler")
    print(markdown_table(rows))
    return rows
