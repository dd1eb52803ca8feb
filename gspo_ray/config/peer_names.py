"""What TRL's GRPOConfig and verl's config call the settings gspo-ray has, so an unknown key from either gets
the field to use instead (`config/loading.py`). Keys are the last part of the unknown key, as written."""
from __future__ import annotations

# peer key -> (who uses it, the gspo-ray field, what differs)
PEER_NAMES: dict[str, tuple[str, str, str]] = {
    "learning_rate": ("TRL", "trainer.lr", ""),
    "num_generations": ("TRL", "rollout.group_size", "completions per prompt"),
    "per_device_train_batch_size": ("TRL", "coordinator.prompts_per_step",
                                    "groups per step; completions per step = prompts_per_step x rollout.group_size; "
                                    "trainer.micro_batch_size sets the micro-batch"),
    "max_completion_length": ("TRL", "rollout.max_new_tokens", ""),
    "max_prompt_length": ("TRL", "rollout.max_model_len", "prompt + completion"),
    "epsilon": ("TRL", "algorithm.eps_low", "and algorithm.eps_high"),
    "epsilon_high": ("TRL", "algorithm.eps_high", ""),
    "max_grad_norm": ("TRL", "trainer.grad_clip", ""),
    "warmup_steps": ("TRL", "trainer.lr_warmup_steps", ""),
    "lr_scheduler_type": ("TRL", "trainer.lr_schedule", ""),
    "max_steps": ("TRL", "coordinator.steps", "rollout batches"),
    "save_steps": ("TRL", "coordinator.checkpoint_every", ""),
    "save_total_limit": ("TRL", "coordinator.keep_checkpoints", ""),
    "eval_steps": ("TRL", "coordinator.eval_every", ""),
    "output_dir": ("TRL", "logging.out_dir", "the run directory is <out_dir>/<name>"),
    "loss_type": ("TRL", "algorithm.aggregation", ""),
    "scale_rewards": ("TRL", "algorithm.advantage.scale_by_std", ""),
    "reward_funcs": ("TRL", "rollout.reward.fn", "one function, called once per sample"),
    "bf16": ("TRL", "trainer.dtype", "bfloat16"),
    "n": ("verl", "rollout.group_size", "completions per prompt"),
    "clip_ratio": ("verl", "algorithm.eps_low", "and algorithm.eps_high"),
    "clip_ratio_low": ("verl", "algorithm.eps_low", ""),
    "clip_ratio_high": ("verl", "algorithm.eps_high", ""),
    "kl_loss_coef": ("verl", "algorithm.beta", ""),
    "kl_coef": ("verl", "algorithm.beta", ""),
    "kl_loss_type": ("verl", "algorithm.kl_estimator", ""),
    "loss_agg_mode": ("verl", "algorithm.aggregation", ""),
    "ppo_epochs": ("verl", "coordinator.num_iterations", ""),
    "ppo_mini_batch_size": ("verl", "coordinator.num_minibatches", "the number of mini-batches, not their size"),
    "ppo_micro_batch_size_per_gpu": ("verl", "trainer.micro_batch_size", ""),
    "ppo_micro_batch_size": ("verl", "trainer.micro_batch_size", ""),
    "train_batch_size": ("verl", "coordinator.prompts_per_step", "prompts (groups) per step"),
    "max_response_length": ("verl", "rollout.max_new_tokens", ""),
    "response_length": ("verl", "rollout.max_new_tokens", ""),
    "total_training_steps": ("verl", "coordinator.steps", ""),
    "save_freq": ("verl", "coordinator.checkpoint_every", ""),
    "test_freq": ("verl", "coordinator.eval_every", ""),
    "max_ckpt_to_keep": ("verl", "coordinator.keep_checkpoints", ""),
    "tensor_model_parallel_size": ("verl", "trainer.tp", ""),
    "expert_model_parallel_size": ("verl", "trainer.ep", ""),
    "compute_score": ("verl", "rollout.reward.fn", "one function, called once per sample"),
}


def peer_hint(key: str) -> str | None:
    """`TRL's learning_rate is trainer.lr here` for a key TRL or verl use, else None."""
    found = PEER_NAMES.get(key)
    if found is None:
        return None
    who, ours, note = found
    return f"{who}'s {key} is {ours} here" + (f" ({note})" if note else "")
