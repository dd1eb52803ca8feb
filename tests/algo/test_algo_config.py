"""Config errors for bad combinations of the algorithm options (eps auto, dilution mask, robust advantages,
mismatch corrections), raised by `load_config` before anything starts."""
import pytest

from gspo_ray.config import ConfigError, load_config

REUSE = ["coordinator.num_iterations=2", "coordinator.num_minibatches=4"]


def _load(*overrides):
    return load_config(None, list(overrides))


@pytest.mark.parametrize("overrides,match", [
    (["algorithm.eps=auto", "algorithm.importance_sampling_level=token", *REUSE], "algorithm.eps 'auto'"),
    (["algorithm.eps=auto"], "reuse mini-batches"),  # 1 pass x 1 mini-batch, sync: nothing to measure
    (["algorithm.mismatch_correction.level=geometric"], "recompute_old_logprobs"),
    # token TIS under GSPO's one ratio per completion: only a per-completion weight mean_t min(rho_t, C)
    (["algorithm.mismatch_correction.level=token", "coordinator.recompute_old_logprobs=true"],
     r"mismatch_correction\.level 'token' with mode 'truncate'.*importance_sampling_level 'sequence'"),
    (["algorithm.dilution_mask=token", "algorithm.importance_sampling_level=token"], "dilution_mask"),
    (["algorithm.advantage.robust=rank", "algorithm.advantage.per_token=true",
      "algorithm.importance_sampling_level=sequence_token"], "advantage.robust"),
    (["algorithm.auto_eps.min_eps=0.1", "algorithm.auto_eps.max_eps=0.01"], "min_eps"),
    (["algorithm.advantage.robust=median"], "algorithm.advantage.robust"),
    (["algorithm.mismatch_correction.upper=0.9"], "mismatch_correction.upper"),
    (["algorithm.eps=0.2"], "algorithm.eps"),
])
def test_bad_combinations_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        _load(*overrides)


def test_good_combinations_load():
    cfg = _load("algorithm.eps=auto", *REUSE, "coordinator.recompute_old_logprobs=true",
                "algorithm.mismatch_correction.level=geometric", "algorithm.mismatch_correction.mode=mask",
                "algorithm.dilution_mask=sequence", "algorithm.advantage.robust=clip")
    a = cfg.algorithm
    assert (a.eps, a.mismatch_correction.level, a.dilution_mask, a.advantage.robust) == \
        ("auto", "geometric", "sequence", "clip")
    assert a.auto_eps.target_clip_frac == 0.15  # the GSPO paper's clipped fraction at 3e-4 / 4e-4
    # async mode reuses stale batches even with one mini-batch per step
    assert _load("algorithm.eps=auto", "coordinator.mode=async").algorithm.eps == "auto"
    # defaults: everything off
    d = _load().algorithm
    assert (d.eps, d.dilution_mask, d.advantage.robust, d.mismatch_correction.level) == \
        ("fixed", "none", "none", "none")


def test_token_level_corrections_where_each_token_keeps_its_weight_load():
    recompute = "coordinator.recompute_old_logprobs=true"
    for overrides in (["algorithm.importance_sampling_level=sequence_token"],  # GSPO-token: per-token gradients
                      ["algorithm.importance_sampling_level=token"],           # GRPO
                      ["algorithm.mismatch_correction.mode=mask"]):             # IcePop: a masked token leaves s
        cfg = _load(recompute, "algorithm.mismatch_correction.level=token", *overrides)
        assert cfg.algorithm.mismatch_correction.level == "token"
