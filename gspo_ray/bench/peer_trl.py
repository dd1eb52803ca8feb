"""The peer, measured on this machine: TRL's `GRPOTrainer` on the SmolLM2 recipe's model, prompts, reward and settings.

    make bench-trl                    # builds .venv-trl (TRL outside the project's dependencies) and runs this
    .venv-trl/bin/python -m gspo_ray.bench.peer_trl --steps 6 --lr 1e-6

TRL is not a dependency of gspo-ray: this module runs in its own virtual environment (TRL, accelerate and datasets
beside the project's torch and transformers pins) and imports from gspo-ray only the pure parts, the config loader,
the prompt generator and the reward, so both sides train on the same prompts in the same order with the same reward.
Settings as `recipes/smollm2_repeat.yaml` and the smollm2 speed bench: 8 prompts x 8 completions per step, <= 32 new
tokens, temperature 1.0, fp32, one optimizer step per rollout batch (steps_per_generation = gradient accumulation = 1),
GSPO (sequence-level ratio, eps 3e-4 / 4e-4, beta 0, the paper-index settings of TRL's docs), AdamW at a constant lr,
grad clip 1.0, HF generate, 2 torch threads. Prints per step: seconds, generation (TRL's generate-and-score, timed
by wrapping it) and train (the rest), completions/s, and the process's peak RSS (one process: TRL's whole job).
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path

from gspo_ray.bench.common import SMOLLM2_RECIPE, markdown_table


def run_trl(steps: int, lr: float, model_dir: Path, out_dir: Path, seed: int = 0) -> list[dict]:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gspo_ray.config import load_config
    from gspo_ray.data.tasks import build_task_splits
    from gspo_ray.envs import rewards

    torch.set_num_threads(2)
    cfg = load_config(SMOLLM2_RECIPE, [f"seed={seed}"])
    data, rollout = cfg.data, cfg.rollout
    train, _ = build_task_splits(data.task, num_train=data.num_train, num_eval=data.num_eval, seed=seed,
                                 min_digits=data.min_digits, max_digits=data.max_digits)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": e.prompt}], tokenize=False,
                                             add_generation_prompt=True) for e in train]
    dataset = Dataset.from_dict({"prompt": prompts, "reference": [e.reference for e in train]})
    reward_fn = getattr(rewards, cfg.rollout.reward.fn.rsplit(":", 1)[1])

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
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer)

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

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **kw):
            step_s = time.perf_counter() - self.t0
            gen = generation[-1] if generation else 0.0
            rows.append({"step": len(rows) + 1, "step_s": step_s, "generation_s": gen, "train_s": step_s - gen,
                         "completions_per_s": per_step / step_s,
                         "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2})

        def on_log(self, args, state, control, logs=None, **kw):
            if rows and logs:
                rows[-1].update({k: logs[k] for k in ("reward", "completions/mean_length") if k in logs})

    trainer.add_callback(StepTimer())
    trainer.train()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=Path("runs/models/smollm2-135m-instruct"))
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no HF model there; `make bench` (or `gspo-ray models import`) "
                         "imports SmolLM2 there first")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        rows = run_trl(args.steps, args.lr, args.model, Path(tmp), args.seed)
    print(f"TRL GRPOTrainer (GSPO settings), SmolLM2 recipe, lr {args.lr}, per step:")
    print(markdown_table(rows))
    steady = rows[1:] or rows
    med = lambda k: statistics.median(r[k] for r in steady)  # noqa: E731
    print(f"median of steps 2..{len(rows)}: {med('step_s'):.1f} s/step, generation {med('generation_s'):.1f} s, "
          f"train {med('train_s'):.1f} s, {med('completions_per_s'):.2f} completions/s, "
          f"peak RSS {max(r['peak_rss_gib'] for r in rows):.1f} GiB", flush=True)


if __name__ == "__main__":
    main()
