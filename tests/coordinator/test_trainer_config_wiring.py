"""What the job hands the trainer besides its own section: Dr.GRPO's norm_len as a constant (the completion
limit, never the padded batch width), and sampling settings the trainer can follow (temperature yes; top-p /
top-k truncation refused with the field named)."""
from __future__ import annotations

import pytest

from gspo_ray.config import ConfigError, JobConfig, MultiTurnConfig, load_config
from gspo_ray.coordinator.pools import trainer_algorithm

DR_GRPO = {"importance_sampling_level": "token", "aggregation": "seq-mean-token-sum-norm"}


def test_norm_len_defaults_to_the_completion_limit():
    cfg = JobConfig.model_validate({"algorithm": DR_GRPO, "rollout": {"max_new_tokens": 24}})
    assert cfg.algorithm.norm_len is None
    assert trainer_algorithm(cfg).norm_len == 24  # constant: the same for every mini-batch, whatever its padding


def test_norm_len_of_episodes_is_their_token_limit():
    cfg = JobConfig.model_validate({"algorithm": DR_GRPO})
    cfg.rollout.multi_turn = MultiTurnConfig(max_total_tokens=40)
    assert trainer_algorithm(cfg).norm_len == 40


def test_an_explicit_norm_len_is_kept():
    cfg = JobConfig.model_validate({"algorithm": {**DR_GRPO, "norm_len": 7}, "rollout": {"max_new_tokens": 24}})
    assert trainer_algorithm(cfg).norm_len == 7


@pytest.mark.parametrize("override,field", [("rollout.top_p=0.9", "rollout.top_p"),
                                            ("rollout.top_k=20", "rollout.top_k")])
def test_truncated_sampling_is_refused_naming_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [override])


def test_temperature_and_untruncated_settings_are_accepted():
    cfg = load_config(None, ["rollout.temperature=0.7", "rollout.top_k=-1", "rollout.top_p=1.0"])
    assert cfg.rollout.temperature == 0.7
