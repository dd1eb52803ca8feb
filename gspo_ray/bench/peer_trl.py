"""The peer, measured on this machine: TRL's `GRPOTrainer` on the SmolLM2 recipe's model, prompts, reward and settings.

    make bench-trl                    # builds .venv-trl (TRL outside the project's dependencies) and runs this
    .venv-trl/bin/python -m gspo_ray.bench.peer_trl --steps 6 --lr 1e-6
    make bench-trl ARGS="--recipe gspo_ray/recipes/smollm2_sum.yaml --steps 10 --lr 1e-5 --eval-every 5 --seed 0"
    make bench-trl ARGS="--recipe gspo_ray/recipes/smollm2_sum_lora.yaml --lora --steps 7 --lr 2e-5"   # TRL + peft

TRL is not a dependency of gspo-ray: this module runs in its own virtual environment (TRL, accelerate and datasets
beside the project's torch and transformers pins) and imports from gspo-ray only the pure parts, the config loader,
the prompt generator and the reward, so both sides train on the same prompts in the same order with the same reward.
Settings as `recipes/smollm2_repeat.yaml` and the smollm2 speed bench: 8 prompts x 8 completions per step, <= the
recipe's `rollout.max_new_tokens` new tokens (16), temperature 1.0, fp32, one optimizer step per rollout batch (steps_per_generation = gradient accumulation = 1),
GSPO (sequence-level ratio, eps 3e-4 / 4e-4, beta 0, the paper-index settings of TRL's docs), AdamW at a constant lr,
grad clip 1.0, HF generate, 2 torch threads. Prints per step: seconds, generation (TRL's generate-and-score, timed
by wrapping it) and train (the rest), completions/s, and the process's peak RSS (one process: TRL's whole job).
`--recipe` takes another recipe's task, reward, temperature and batch shape; `--eval-every N` scores the recipe's
held-out prompts (the same ones gspo-ray evaluates, from the data seed) greedily with HF generate at step 0 and every
N steps, as gspo-ray's evaluation does: the learning comparison. `--lora` trains a peft `LoraConfig` with the
recipe's `trainer.lora` rank, alpha, dropout and target modules (TRL's `peft_config`), the base frozen.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

from gspo_ray.bench.common import SMOLLM2_RECIPE, markdown_table


def held_out_exact(model, tokenizer, prompts: list[str], references: list[str], reward_fn, max_new_tokens: int,
                   batch: int = 16) -> tuple[float, float]:
    """Greedy completions of the held-out prompts: (mean exact, mean reward), as gspo-ray's evaluation scores them."""
    import torch

    exact = reward = 0.0
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for i in range(0, len(prompts), batch):
                enc = tokenizer(prompts[i:i + batch], return_tensors="pt", padding=True, add_special_tokens=False)
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)
                for row, ref in zip(out[:, enc["input_ids"].shape[1]:], references[i:i + batch]):
                    scored = reward_fn(tokenizer.decode(row, skip_special_tokens=True), ref)
                    exact, reward = exact + scored.get("exact", 0.0), reward + scored["reward"]
    finally:
        tokenizer.padding_side = side
        model.train(training)
    return exact / len(prompts), reward / len(prompts)


def peft_config(lora):
    """The recipe's `trainer.lora` as peft's LoraConfig (the same rank, alpha, dropout and HF target modules)."""
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), task_type="CAUSAL_LM")


def run_trl(steps: int, lr: float, model_dir: Path, out_dir: Path, seed: int = 0, recipe: Path = SMOLLM2_RECIPE,
            eval_every: int = 0, lora: bool = False) -> tuple[list[dict], list[dict]]:
    """TRL's GRPOTrainer on `recipe`'s task: (a row per step, the held-out evaluations). `lora`: train the
    recipe's `trainer.lora` adapters through peft instead of every weight."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gspo_ray.config import load_config
    from gspo_ray.data.prompts import PromptSource
    from gspo_ray.envs.plugins import resolve_callable

    torch.set_num_threads(2)
    cfg = load_config(recipe, [f"seed={seed}"])
    rollout = cfg.rollout
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # the recipe's own prompt sources (built-in task or files, chat template, system prompt) and its data seed, as
    # gspo-ray's learn bench keeps it: the same prompts and the same held-out set for every seed
    limits = dict(max_new_tokens=rollout.max_new_tokens, max_model_len=rollout.max_model_len)
    train, held_out = (PromptSource.from_config(cfg.data, tokenizer, split=split, **limits)
                       for split in ("train", "eval"))
    train_prompts = train.prompts()
    dataset = Dataset.from_dict({"prompt": [p.text for p in train_prompts],
                                 "reference": [p.reference for p in train_prompts]})
    reward_fn = resolve_callable(cfg.rollout.reward.fn, "rollout.reward.fn")

    def reward(prompts, completions, reference, **_):
        return [reward_fn(c, r)["reward"] for c, r in zip(completions, reference)]

    eps_low, eps_high = cfg.algorithm.clip_range()
    per_step = cfg.coordinator.prompts_per_step * rollout.group_size
    args = GRPOConfig(output_dir=str(out_dir), max_steps=steps, learning_rate=lr, lr_scheduler_type="constant",
                      warmup_steps=0, weight_decay=cfg.trainer.weight_decay, max_grad_norm=cfg.trainer.grad_clip,
                      adam_beta1=cfg.trainer.adam_beta1, adam_beta2=cfg.trainer.adam_beta2,
                      adam_epsilon=cfg.trainer.adam_eps, per_device_train_batch_size=per_step,
                      gradient_accumulation_steps=1, steps_per_generation=1, num_generations=rollout.group_size,
                      max_completion_length=rollout.max_new_tokens, temperature=rollout.temperature,
                      importance_sampling_level="sequence", loss_type="grpo", beta=0.0,
                      epsilon=eps_low, epsilon_high=eps_high, use_cpu=True, bf16=False,
                      fp16=False, logging_steps=1, save_strategy="no", report_to=[], seed=seed,
                      shuffle_dataset=False, dataloader_num_workers=0)
    if lora and cfg.trainer.lora is None:
        raise SystemExit(f"--lora: {recipe} has no trainer.lora")
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config(cfg.trainer.lora) if lora else None)

    generation: list[float] = []
    inner = trainer._generate_and_score_completions

    def timed(*a, **kw):  # measurement only: the time TRL spends generating and scoring a batch
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            generation.append(time.perf_counter() - t0)

    trainer._generate_and_score_completions = timed
    rows: list[dict] = []
    evals: list[dict] = []  # held-out scores at step 0 and every eval_every steps
    eval_rows = held_out.prompts() if held_out is not None else []
    eval_prompts, eval_refs = [p.text for p in eval_rows], [p.reference for p in eval_rows]
    t_start = time.perf_counter()

    def evaluate(model, step: int) -> None:
        exact, mean_reward = held_out_exact(model, tokenizer, eval_prompts, eval_refs, reward_fn,
                                            rollout.max_new_tokens)
        evals.append({"step": step, "eval_exact": exact, "eval_reward": mean_reward,
                      "job_s": time.perf_counter() - t_start})
        print(f"step {step}: held-out exact {exact:.3f}, reward {mean_reward:.3f}", flush=True)

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            if eval_every:
                evaluate(model, 0)

        def on_step_begin(self, *a, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            step_s = time.perf_counter() - self.t0
            gen = generation[-1] if generation else 0.0
            rows.append({"step": len(rows) + 1, "step_s": step_s, "generation_s": gen, "train_s": step_s - gen,
                         "completions_per_s": per_step / step_s,
                         "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2})
            if eval_every and len(rows) % eval_every == 0:
                evaluate(model, len(rows))

        def on_log(self, args, state, control, logs=None, **kw):
            if rows and logs:
                rows[-1].update({k: logs[k] for k in ("reward", "completions/mean_length") if k in logs})

    trainer.add_callback(StepTimer())
    trainer.train()
    return rows, evals


def as_learn_run(rows: list[dict], evals: list[dict], seed: int) -> dict:
    """The run in the learn bench's format (bench/learning.py), so its tables and plot show it beside gspo-ray's."""
    from gspo_ray.bench.learning import SOLVED

    curve = [(e["step"], e["job_s"], e["eval_exact"], e["eval_reward"]) for e in evals]
    solved = next(((s, t) for s, t, e, _ in curve if e >= SOLVED), (None, None))
    return {"peer": "TRL 1.16", "seed": seed, "curve": curve, "solved_at": solved[0], "solved_job_s": solved[1],
            "train_s": sum(r["step_s"] for r in rows), "wall_s": evals[-1]["job_s"], "steps": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=Path("runs/models/smollm2-135m-instruct"))
    parser.add_argument("--recipe", type=Path, default=SMOLLM2_RECIPE,
                        help="the recipe whose task, reward, temperature and batch shape TRL trains with")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="score the held-out prompts greedily at step 0 and every N steps (0: never)")
    parser.add_argument("--lora", action="store_true",
                        help="train the recipe's trainer.lora adapters with peft (the base frozen)")
    args = parser.parse_args()
    if not args.recipe.is_file():
        raise SystemExit(f"--recipe {args.recipe}: file not found")
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no HF model there; `make bench` (or `gspo-ray models import`) "
                         "imports SmolLM2 there first")
    import tempfile

    from gspo_ray.config import load_config

    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        rows, evals = run_trl(args.steps, args.lr, args.model, Path(tmp), args.seed, args.recipe, args.eval_every,
                              args.lora)
    print(f"TRL GRPOTrainer (GSPO settings{', peft LoRA' if args.lora else ''}), {args.recipe.name}, lr {args.lr}, "
          f"seed {args.seed}, per step:")
    print(markdown_table(rows))
    if evals:
        print("held-out (greedy), seconds since the trainer was built:")
        print(markdown_table(evals))
        out = Path("runs/bench") / f"trl_{load_config(args.recipe).name}_s{args.seed}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(as_learn_run(rows, evals, args.seed), indent=1))
        print(f"written: {out} (`gspo-ray bench --suite learn --recipe {args.recipe}` draws it beside its seeds)")
    steady = rows[1:] or rows
    med = lambda k: statistics.median(r[k] for r in steady)  # noqa: E731
    print(f"median of steps 2..{len(rows)}: {med('step_s'):.1f} s/step, generation {med('generation_s'):.1f} s, "
          f"train {med('train_s'):.1f} s, {med('completions_per_s'):.2f} completions/s, "
          f"peak RSS {max(r['peak_rss_gib'] for r in rows):.1f} GiB", flush=True)


if __name__ == "__main__":
    main()
