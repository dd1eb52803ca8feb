"""Job config: defaults from the GSPO paper, clear errors naming the field, overrides, the packaged recipe."""
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_ray.config import ConfigError, JobConfig, dump_config, load_config

RECIPE = Path(__file__).resolve().parents[1] / "gspo_ray" / "recipes" / "tiny_moe.yaml"


def test_defaults_are_gspo():
    cfg = JobConfig()
    assert cfg.algorithm.importance_sampling_level == "sequence"
    assert cfg.algorithm.clip_range() == (3e-4, 4e-4)
    assert cfg.algorithm.aggregation == "seq-mean-token-mean"
    assert cfg.algorithm.advantage.eps == 1e-4 and cfg.algorithm.advantage.scale_by_std


@pytest.mark.parametrize("level,expected", [("token", (0.2, 0.27)), ("sequence_token", (3e-4, 4e-4))])
def test_clip_defaults_follow_level(level, expected):
    cfg = load_config(None, [f"algorithm.importance_sampling_level={level}"])
    assert cfg.algorithm.clip_range() == expected
    # an explicit value wins over the level default (DAPO clip-higher)
    cfg = load_config(None, [f"algorithm.importance_sampling_level={level}", "algorithm.eps_high=0.28"])
    assert cfg.algorithm.clip_range()[1] == 0.28


@pytest.mark.parametrize("override,field", [
    ("algorithm.aggregation=token-mean", "algorithm"),         # length-weighted aggregation with GSPO
    ("algorithm.aggregation=seq-mean-token-sum-norm", "algorithm"),
    ("algorithm.eps_low=0", "algorithm.eps_low"),
    ("algorithm.eps_high=-0.1", "algorithm.eps_high"),
    ("rollout.group_size=1", "rollout.group_size"),
    ("trainer.colour=blue", "trainer.colour"),                  # unknown key
    ("trainer.tp=2", "trainer"),                               # tp does not divide the world
    ("coordinator.num_minibatches=3", "coordinator"),          # 3 does not divide 16 groups
    ("algorithm.advantage.per_token=true", "algorithm"),       # per-token advantages need sequence_token
    ("rollout.max_new_tokens=64", "(job)"),
    ("trainer.micro_batch_tokens=32", "(job)"),                # a micro-batch below the longest row
])
def test_bad_input_names_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, [override])
    msg = str(e.value)
    assert str(RECIPE) in msg and f"  {field}:" in msg, msg


def test_per_token_advantages_allowed_with_sequence_token():
    cfg = load_config(None, ["algorithm.importance_sampling_level=sequence_token", "algorithm.advantage.per_token=true"])
    assert cfg.algorithm.advantage.per_token


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"data\.path: file not found"):
        load_config(None, ["data.source=jsonl", f"data.path={tmp_path}/train.jsonl"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_recipe_round_trips_through_show(tmp_path):
    cfg = load_config(RECIPE)
    assert cfg.model.tiny.arch == "qwen3_moe" and cfg.model.tiny.experts >= 4 and cfg.model.tiny.top_k == 2
    again = tmp_path / "effective.yaml"
    again.write_text(dump_config(cfg))
    assert load_config(again) == cfg


def test_cli_validate_exit_codes():
    ok = subprocess.run([sys.executable, "-m", "gspo_ray.cli", "config", "validate", str(RECIPE)],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "gspo_ray.cli", "config", "validate", str(RECIPE),
                          "rollout.group_size=1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "rollout.group_size" in bad.stderr


@pytest.mark.parametrize("value", ["1.0", "1.5"])
def test_auto_eps_max_eps_of_one_or_more_is_refused(value):
    """max_eps >= 1 was accepted and crashed the trainer (a clip band reaching 1 - eps_low <= 0)."""
    with pytest.raises(ConfigError, match=r"algorithm\.auto_eps\.max_eps.*must be < 1"):
        load_config(RECIPE, [f"algorithm.auto_eps.max_eps={value}"])
    assert load_config(RECIPE, ["algorithm.auto_eps.max_eps=0.5"]).algorithm.auto_eps.max_eps == 0.5


def test_coordinator_staleness_that_partial_rollouts_would_ignore_is_refused():
    partial = ["rollout.partial.segment_tokens=2", "rollout.partial.stale_policy=mask"]
    with pytest.raises(ConfigError, match=r"coordinator\.max_staleness \(3\).*rollout\.partial\.max_staleness"):
        load_config(RECIPE, [*partial, "coordinator.max_staleness=3"])
    cfg = load_config(RECIPE, [*partial, "rollout.partial.max_staleness=3"])  # the field partial rollouts use
    assert cfg.rollout.partial.max_staleness == 3
    assert load_config(RECIPE, ["coordinator.max_staleness=3"]).coordinator.max_staleness == 3  # without partial


def test_partial_keep_is_refused_where_a_token_age_would_go_unseen():
    keep = ["rollout.partial.segment_tokens=2", "rollout.partial.stale_policy=keep"]
    # keep trains tokens of any age: a max_staleness beside it would be ignored
    with pytest.raises(ConfigError, match=r"rollout\.partial\.max_staleness \(2\) is not used.*'keep'"):
        load_config(RECIPE, [*keep, "rollout.partial.max_staleness=2"])
    # a recomputed anchor is the current policy: a stale token would train as on-policy, unclipped (sync mode,
    # fixed band: the async / eps-auto refusals of the recomputed anchor would speak first)
    recompute = ["coordinator.recompute_old_logprobs=true", "algorithm.eps=fixed"]
    with pytest.raises(ConfigError, match=r"stale_policy 'keep' with coordinator\.recompute_old_logprobs"):
        load_config(RECIPE, [*keep, *recompute, "coordinator.mode=sync"])
    ok = load_config(RECIPE, [*keep, *recompute, "algorithm.mismatch_correction.level=geometric"])
    assert ok.rollout.partial.stale_policy == "keep" and load_config(RECIPE, keep).rollout.partial is not None
    masked = load_config(RECIPE, ["rollout.partial.segment_tokens=2", "rollout.partial.stale_policy=mask",
                                  *recompute, "algorithm.mismatch_correction.level=geometric",
                                  "rollout.partial.max_staleness=2"])
    assert masked.rollout.partial.max_staleness == 2


def test_the_job_seed_seeds_the_engines_unless_rollout_seed_is_set():
    """`seed=1` alone gives other samples (before, every "seed" of a pretrained model repeated one run)."""
    assert JobConfig().rollout.seed == 0
    assert JobConfig.model_validate({"seed": 3}).rollout.seed == 3
    assert JobConfig.model_validate({"seed": 3, "rollout": {"seed": 7}}).rollout.seed == 7


@pytest.mark.parametrize("dtypes", [["rollout.dtype=bfloat16"], ["trainer.dtype=bfloat16"],
                                    ["rollout.dtype=bfloat16", "trainer.dtype=bfloat16"]])
def test_bf16_with_the_engine_anchor_is_accepted_the_job_measures_its_gap(dtypes):
    """bf16 with the engine's log-probs as the anchor is no longer refused at config time: the job measures their
    gap to the trainer's at step 1 and stops there if the band cannot hold it (tests/algo/test_anchor_gap.py)."""
    cfg = load_config(RECIPE, dtypes)
    assert not cfg.coordinator.recompute_old_logprobs and cfg.coordinator.anchor_gap_every == 10
    cfg = load_config(RECIPE, [*dtypes, "coordinator.recompute_old_logprobs=true", "algorithm.eps=fixed",
                               "algorithm.mismatch_correction.level=sequence"])
    assert [f"{k}.dtype={getattr(cfg, k).dtype}" for k in ("rollout", "trainer") if f"{k}.dtype=bfloat16" in dtypes] == dtypes
    assert load_config(None, []).rollout.dtype == "float32"  # the default (the recipe's auto: tests/conftest.py)


def test_the_recomputed_anchor_in_async_one_pass_is_refused_where_it_silences_the_ratio():
    """The recipe is async, 1 pass x 1 mini-batch, eps auto. With the trainer recomputing the old log-probs the
    only mini-batch trains against its own policy: the ratio is 1 (no band clips, auto never observes), and the
    samples' one-update staleness is corrected only by mismatch_correction. Both are refused, each by its field."""
    recompute = ["rollout.dtype=bfloat16", "coordinator.recompute_old_logprobs=true"]
    with pytest.raises(ConfigError, match="algorithm.eps 'auto' .* the trainer recomputes the old log-probs"):
        load_config(RECIPE, [*recompute, "algorithm.mismatch_correction.level=sequence"])
    with pytest.raises(ConfigError, match="coordinator.mode async with coordinator.recompute_old_logprobs needs "
                                          "algorithm.mismatch_correction"):
        load_config(RECIPE, [*recompute, "algorithm.eps=fixed"])
    # with reuse mini-batches auto has drift to measure, even on the recomputed anchor
    cfg = load_config(RECIPE, [*recompute, "coordinator.num_minibatches=2",
                               "algorithm.mismatch_correction.level=geometric"])
    assert cfg.algorithm.eps == "auto"
    # sync mode with recompute has no staleness to correct: a fixed band alone is accepted
    assert load_config(RECIPE, [*recompute, "algorithm.eps=fixed", "coordinator.mode=sync"]).coordinator.mode == "sync"


@pytest.mark.parametrize("overrides,words", [
    (["trainer.num_workers=3", "trainer.cp=2"], r"trainer\.tp x trainer\.cp \(1 x 2\) must divide trainer\.num_workers \(3\)"),
    (["trainer.num_workers=2", "trainer.cp=2", "trainer.micro_batch_tokens=258"],
     r"trainer\.micro_batch_tokens \(258\) must be a multiple of 2 x trainer\.cp \(4\)"),
    (["trainer.num_workers=2", "trainer.cp=2", "trainer.routing_noise=true", "trainer.routing_agreement=true"],
     r"trainer\.cp \(2\) > 1 does not run beside trainer\.routing_noise, trainer\.routing_agreement"),
    (["trainer.num_workers=2", "trainer.cp=2", "trainer.routing_replay=R3"], r"beside trainer\.routing_replay"),
    (["trainer.num_workers=4", "trainer.cp=2", "trainer.pp=2"], r"trainer\.cp \(2\) and trainer\.pp \(2\) > 1 "
                                                                  r"together are not built"),
])
def test_context_parallel_layouts_and_features_refused_by_name(overrides, words):
    """trainer.cp: tp x cp divides the ranks, micro_batch_tokens splits into 2 x cp chunks, and the features not
    built under CP are named (one line)."""
    with pytest.raises(ConfigError, match=words) as e:
        load_config(RECIPE, overrides)
    assert len([line for line in str(e.value).splitlines() if "trainer" in line]) == 1, str(e.value)


def test_a_context_parallel_layout_loads_with_dp_over_tp_x_cp():
    good = load_config(RECIPE, ["trainer.num_workers=4", "trainer.cp=2", "trainer.micro_batch_tokens=256"])
    assert (good.trainer.cp, good.trainer.dp) == (2, 2)
    assert good.trainer.resize_problem(5) == "trainer.tp x trainer.cp (2) must divide trainer.num_workers (5)"
    assert good.trainer.resize_problem(6) is None


@pytest.mark.parametrize("overrides,names", [
    (["trainer.num_workers=3", "trainer.pp=2"], ["trainer.tp x trainer.pp"]),  # 2 stages do not divide 3 ranks
    (["trainer.num_workers=2", "trainer.pp=2", "trainer.ep=2"], ["trainer.ep x trainer.pp"]),  # 1 rank a stage
    (["trainer.num_workers=2", "trainer.pp=2", "trainer.lora.rank=4"], ["trainer.lora"]),
    (["trainer.num_workers=2", "trainer.pp=2", "trainer.routing_agreement=true"], ["trainer.routing_agreement"]),
    (["trainer.num_workers=2", "trainer.pp=2", "trainer.routing_replay=R2"], ["trainer.routing_replay"]),
])
def test_pipeline_refusals_name_the_fields(overrides, names):
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, overrides)
    assert all(n in str(e.value) for n in names + ["trainer.pp"]), str(e.value)


@pytest.mark.parametrize("layout,on", [(dict(num_workers=2, cp=2), True), (dict(num_workers=2), True),
                                       (dict(num_workers=2, pp=2), False), (dict(num_workers=2, tp=2), False),
                                       (dict(num_workers=8, tp=2, pp=2), True)])
def test_distributed_optimizer_is_on_by_default_exactly_when_dp_x_cp_is_above_one(layout, on):
    """Megatron shards the distributed optimizer over the data-and-context-parallel group: DP 1 x CP 2 has two
    ranks to shard over. The memory model's default (trainer/memory.Layout) is the config's."""
    from gspo_ray.config import TrainerConfig
    from gspo_ray.trainer.memory import Layout

    cfg = TrainerConfig(**layout)
    assert cfg.distributed_optimizer is on
    assert Layout(world=cfg.num_workers, tp=cfg.tp, cp=cfg.cp, pp=cfg.pp).distributed is on


def test_pipeline_resize_keeps_whole_stages():
    from gspo_ray.config import TrainerConfig

    cfg = TrainerConfig(num_workers=4, pp=2)
    assert cfg.dp == 2 and cfg.resize_problem(6) is None
    assert "trainer.tp x trainer.pp (2) must divide trainer.num_workers (3)" in cfg.resize_problem(3)


def test_pipeline_preflight_reads_the_model():
    """What depends on the model is judged by the preflight (before Ray): trainer.pp must divide its layers, and
    an MoE's token dispatcher must take micro-batches of varying shapes; the recipe's tiny MoE has 2 layers."""
    from gspo_ray.preflight.job_model import check_tiny_config
    from gspo_ray.preflight.model import PreflightError

    with pytest.raises(PreflightError, match=r"trainer\.pp \(4\) must divide the model's 2 layers"):
        check_tiny_config(load_config(RECIPE, ["trainer.num_workers=4", "trainer.pp=4"]), on_cpu=True)
    with pytest.raises(PreflightError, match=r"trainer\.moe_dispatcher allgather"):
        check_tiny_config(load_config(RECIPE, ["trainer.num_workers=2", "trainer.pp=2",
                                               "trainer.moe_dispatcher=allgather"]), on_cpu=True)
    with pytest.raises(PreflightError, match=r"rollout\.weight_transfer nccl cannot push from trainer\.pp"):
        check_tiny_config(load_config(RECIPE, ["trainer.num_workers=2", "trainer.pp=2", "rollout.weight_transfer=nccl",
                                               "trainer.num_gpus_per_worker=1", "rollout.num_gpus_per_worker=1"]),
                          on_cpu=True)
    check_tiny_config(load_config(RECIPE, ["trainer.num_workers=2", "trainer.pp=2"]), on_cpu=True)
