"""`gspo-ray scale trainer N` that the cluster cannot place is refused before anything is saved or stopped: the
step's metrics say `job/trainer_scale_refused`, and the job's control status says why (the channel `gspo-ray scale`
reads). A distributed optimizer is no reason to refuse: its state reshards on load (trainer/checkpoints/shards.py)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import ray

from gspo_ray.config import load_config
from gspo_ray.coordinator.control import JobControl
from gspo_ray.coordinator.job import _apply_control
from gspo_ray.coordinator.loop import LoopState
from gspo_ray.coordinator.pools import trainer_pool_config
from gspo_ray.coordinator.recovery import TrainerRecovery

RECIPE = "gspo_ray/recipes/tiny_moe.yaml"


def _job(tmp_path, *overrides):
    return load_config(RECIPE, [f"logging.out_dir={tmp_path}", *overrides])


def _running(cfg):
    """What the resize checks read of a running job: its trainer pool's size and config (nothing is started)."""
    trainer = SimpleNamespace(num_workers=cfg.trainer.num_workers, cfg=trainer_pool_config(cfg))
    return SimpleNamespace(trainer=trainer, rollout=SimpleNamespace(num_workers=1), state=LoopState(step=3))


def _never(*_):
    raise AssertionError("a refused resize must not save (nor stop the pool)")


@pytest.mark.parametrize("logged", [True, False], ids=["logged", "log-off"])
@pytest.mark.usefixtures("local_ray")
def test_a_resize_the_cluster_cannot_place_is_refused_before_anything_is_saved(tmp_path, logged):
    """The reason reaches `gspo-ray scale` as the resize's return value: with the job's log switched off (a user's
    logging config, a quiet CLI) the answer still says why, not "the pool stayed at 1"."""
    logging.disable(logging.NOTSET if logged else logging.CRITICAL)
    cfg = _job(tmp_path, "trainer.use_distributed_optimizer=true")
    coord, recovery = _running(cfg), TrainerRecovery(cfg, ckpts=None)
    control = ray.remote(num_cpus=0)(JobControl).remote()
    try:
        request = ray.get(control.scale_trainer.remote(64))
        metrics = {}
        _apply_control(coord, control, metrics, lambda n: recovery.rescale(coord, n, _never), refused=recovery)
        assert metrics["job/trainer_scale_refused"] == 1.0 and metrics["trainer/workers"] == 1
        status = ray.get(control.status.remote())
        refused = status["trainer_scale_refused"]
        assert refused["workers"] == 64 and status["trainer_workers"] == 1
        assert "no room for 64 ranks" in refused["reason"]
        answer = ray.get(control.answer_of.remote(request))  # what `gspo-ray scale` prints (and exits 1 on)
        assert not answer["applied"] and answer["reason"] == refused["reason"] and answer["size"] == 1
    finally:
        logging.disable(logging.NOTSET)
        ray.kill(control)


@pytest.mark.usefixtures("local_ray")
@pytest.mark.parametrize("distributed", ["true", "false"])
def test_a_resize_is_not_refused_for_the_optimizer(tmp_path, distributed):
    # either optimizer's state reshards to any DP size on load (test_live_scaling_job.py, test_checkpoint_reshard.py)
    cfg = _job(tmp_path, f"trainer.use_distributed_optimizer={distributed}")
    recovery = TrainerRecovery(cfg, ckpts=None)
    assert recovery.scale_problem(_running(cfg), 2) is None
