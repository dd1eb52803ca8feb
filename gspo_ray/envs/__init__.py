"""Reward functions and built-in tasks. Plug-ins are selected by import path (`gspo_ray.envs.plugins`)."""

from gspo_ray.envs.rewards import (
    cer_reward,
    compute_cer,
    compute_edit_distance,
    compute_tail_repeats,
    copy_reward,
    exact_match,
)
from gspo_ray.envs.tasks import TASKS, TaskExample, build_task_splits, task_space_size

__all__ = [
    "TASKS",
    "TaskExample",
    "build_task_splits",
    "cer_reward",
    "compute_cer",
    "compute_edit_distance",
    "compute_tail_repeats",
    "copy_reward",
    "exact_match",
    "task_space_size",
]
