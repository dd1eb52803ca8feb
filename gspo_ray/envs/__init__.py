"""Reward functions and multi-turn environments (the built-in task generators are data: `gspo_ray.data.tasks`).
Plug-ins are selected by import path (`gspo_ray.envs.plugins`)."""

from gspo_ray.envs.rewards import (
    cer_reward,
    compute_cer,
    compute_edit_distance,
    compute_tail_repeats,
    copy_reward,
    exact_match,
    extract_final_answer,
    math_verify_reward,
    repeat_chars_reward,
    repeat_reward,
)

__all__ = [
    "cer_reward",
    "compute_cer",
    "compute_edit_distance",
    "compute_tail_repeats",
    "copy_reward",
    "exact_match",
    "extract_final_answer",
    "math_verify_reward",
    "repeat_chars_reward",
    "repeat_reward",
]
