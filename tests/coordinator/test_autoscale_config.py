"""`coordinator.autoscale` bad input: bounds against each other and the budget, a trainer that cannot be resized,
a worker no node holds. One line naming the field, exit 2 from `gspo-ray config validate`, before Ray starts."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from gspo_ray.cli import app
from gspo_ray.config import ConfigError, load_config

RECIPE = "gspo_ray/recipes/tiny_moe.yaml"
ON = "coordinator.autoscale.rollout.max=3"


def test_off_by_default_and_on_with_bounds():
    assert load_config(RECIPE).coordinator.autoscale is None
    a = load_config(RECIPE, [ON, "coordinator.autoscale.max_devices=4"]).coordinator.autoscale
    assert (a.rollout.min, a.rollout.max, a.trainer, a.max_devices) == (1, 3, None, 4)


@pytest.mark.parametrize("overrides, field, says", [
    (["coordinator.autoscale.rollout.min=3", "coordinator.autoscale.rollout.max=2"],
     "coordinator.autoscale.rollout", "min (3) > max (2)"),
    ([ON, "coordinator.autoscale.trainer.min=2", "coordinator.autoscale.trainer.max=1"],
     "coordinator.autoscale.trainer", "min (2) > max (1)"),
    ([ON, "coordinator.autoscale.max_devices=1"], "coordinator.autoscale.max_devices", "below the minimums"),
    ([ON, "coordinator.autoscale.rollout.min=2", "coordinator.autoscale.max_devices=2"],
     "coordinator.autoscale.max_devices", "rollout.min 2 x 1 + trainer.min 1 x 1 = 3"),
    ([ON, "coordinator.autoscale.trainer.max=3", "trainer.ep=2", "trainer.num_workers=2"],
     "coordinator.autoscale.trainer: no size in [1, 3] other than 2", "trainer.ep (2) must divide"),
    ([ON, "coordinator.autoscale.rollout.min=2"], "coordinator.autoscale.rollout", "rollout.num_workers (1) is "
     "outside [2, 3]"),
    ([ON, "rollout.num_cpus_per_worker=9", "cluster.num_cpus=4"], "rollout.num_cpus_per_worker",
     "does not fit any node"),
])
def test_bad_bounds_name_the_field(overrides, field, says):
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, overrides)
    (line,) = e.value.lines()  # one line
    assert field in line and says in line, line


def test_validate_exits_2_with_one_line_before_ray(tmp_path, monkeypatch):
    import ray

    def no_ray(*args, **kwargs):
        raise AssertionError("config validate started Ray")

    # a module before this one in the same process may have started the package's shared Ray: then
    # ray.is_initialized() says nothing of this command, so a start is refused outright
    was_up = ray.is_initialized()
    monkeypatch.setattr(ray, "init", no_ray)
    result = CliRunner().invoke(app, ["config", "validate", RECIPE, ON, "coordinator.autoscale.max_devices=1",
                                      f"logging.out_dir={tmp_path}"])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.strip()]
    assert len(errors) == 1 and "coordinator.autoscale.max_devices" in errors[0], result.output
    assert ray.is_initialized() == was_up and not any(tmp_path.iterdir())


def test_a_distributed_optimizer_is_no_reason_to_refuse_trainer_bounds():
    """Its state reshards on load like the model (trainer/checkpoints/shards.py), so every DP size stays open to the
    controller."""
    cfg = load_config(RECIPE, [ON, "coordinator.autoscale.trainer.max=2", "trainer.use_distributed_optimizer=true"])
    assert cfg.coordinator.autoscale.trainer.max == 2 and cfg.trainer.resize_problem(2) is None
