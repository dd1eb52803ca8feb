"""Job configuration: one YAML file = one job, validated before any expensive work starts.

    gspo-ray config validate gspo_ray/recipes/tiny_moe.yaml
    gspo-ray config show gspo_ray/recipes/tiny_moe.yaml algorithm.importance_sampling_level=token

Each component receives its own sub-config (`RolloutConfig`, `TrainerConfig`, ...), never the whole job. One module
per concern: model, data, rollout, trainer, algorithm, coordinator (and cluster), tracking; job.py ties them into
`JobConfig`; loading.py reads files and overrides. Defaults follow the GSPO paper (sequence-level ratio, clip
3e-4/4e-4, sequence-mean aggregation).
"""
from gspo_ray.config.base import Strict, ConfigError, ImportanceLevel, Aggregation, RUN_NAME, GUESS_ENV, DEFAULT_CLIP
from gspo_ray.config.model import TinyModelConfig, ModelConfig
from gspo_ray.config.data import DataConfig
from gspo_ray.config.rollout import RewardConfig, MultiTurnConfig, PartialRolloutConfig, RolloutConfig
from gspo_ray.config.trainer import TrainerConfig
from gspo_ray.config.algorithm import AdvantageConfig, AutoEpsConfig, MismatchCorrectionConfig, AlgorithmConfig
from gspo_ray.config.coordinator import CoordinatorConfig, ClusterConfig
from gspo_ray.config.tracking import WandbConfig, LoggingConfig
from gspo_ray.config.job import JobConfig
from gspo_ray.config.loading import apply_overrides, section_fields, load_config, dump_config

__all__ = [
    "Strict",
    "ConfigError",
    "ImportanceLevel",
    "Aggregation",
    "RUN_NAME",
    "GUESS_ENV",
    "DEFAULT_CLIP",
    "TinyModelConfig",
    "ModelConfig",
    "DataConfig",
    "RewardConfig",
    "MultiTurnConfig",
    "PartialRolloutConfig",
    "RolloutConfig",
    "TrainerConfig",
    "AdvantageConfig",
    "AutoEpsConfig",
    "MismatchCorrectionConfig",
    "AlgorithmConfig",
    "CoordinatorConfig",
    "ClusterConfig",
    "WandbConfig",
    "LoggingConfig",
    "JobConfig",
    "apply_overrides",
    "section_fields",
    "load_config",
    "dump_config",
]
