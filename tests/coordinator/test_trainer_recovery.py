"""In-job trainer recovery: a trainer rank SIGKILLed mid-run is rebuilt from the last complete checkpoint (or the
initial weights before the first one), the coordinator rewinds to it, the steps since are replayed, and the job
finishes every step, each once in metrics.jsonl; W&B (offline) and TensorBoard end up with metrics.jsonl's values."""
import json
import logging
import os
import signal

import pytest
import ray
import torch

from gspo_ray.config import load_config
from gspo_ray.coordinator.job import TrainerFailed, run_job
from gspo_ray.coordinator.tracking import read_metrics
from tests.coordinator.tracker_files import tensorboard_scalars, wandb_history

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]
RECIPE = "gspo_ray/recipes/tiny_moe.yaml"


def _cfg(tmp_path, *overrides):
    return load_config(RECIPE, [f"logging.out_dir={tmp_path}", "logging.progress=false", "logging.plot=false",
                                "logging.tensorboard=false", "coordinator.eval_every=0", "data.num_eval=0",
                                *overrides])


def trainer_pid(coord, rank: int = 0) -> int:
    return ray.get(coord.trainer.workers[rank].__ray_call__.remote(lambda self: os.getpid()))


def kill_at(steps: set[int], seen: list):
    """after_step hook: SIGKILL trainer rank 0 once after each of `steps` (a lost process, as an OOM kill)."""
    def hook(coord, step):
        seen.append(step)
        if step in steps:
            steps.discard(step)
            os.kill(trainer_pid(coord), signal.SIGKILL)
    return hook


def test_trainer_killed_twice_recovers_in_job(tmp_path):
    # async mode with eps auto (the recipe's): the batch in flight, the band and the prompt cursor are rewound too
    # the distributed optimizer on (its default is off at DP 1): its state saved, restored and stepped in-job
    cfg = _cfg(tmp_path, "coordinator.steps=8", "coordinator.checkpoint_every=4", "name=recover",
               "logging.tensorboard=true", "logging.wandb.mode=offline",  # offline W&B: no network
               "trainer.use_distributed_optimizer=true")
    seen: list[int] = []
    # step 2: before any checkpoint -> back to step 0 (initial weights); step 6: back to the step-4 checkpoint
    summary = run_job(cfg, after_step=kill_at({2, 6}, seen))
    assert summary.steps == 8
    assert seen == [1, 2, 1, 2, 3, 4, 5, 6, 5, 6, 7, 8]                 # what ran: two rewinds, two steps replayed each
    rows = read_metrics(cfg.run_dir / "metrics.jsonl")
    raw = [line for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(raw) == len(rows) == 8 and [r["step"] for r in rows] == list(range(1, 9))  # each step once
    assert [r["train/version"] for r in rows] == list(range(1, 9))      # the policy version rewound with the step
    restarts = [(r["step"], r["job/trainer_restarts"], r["job/steps_replayed"]) for r in rows
                if "job/trainer_restarts" in r]
    assert restarts == [(1, 1, 2), (5, 2, 2)]                            # replayed <= checkpoint_every
    assert [r["step"] for r in rows if r.get("job/replayed")] == [1, 2, 5, 6]  # rows written by a replay
    assert all(r["job/recovery_s"] < 120 for r in rows if "job/recovery_s" in r)
    assert all(r["rollout/failed_samples"] == 0 for r in rows)
    # the restored policy reached the engines: the first push after each recovery is verified against the trainer
    assert all(r["sync/verify_max_abs_diff"] <= 1e-4 for r in rows if "job/trainer_restarts" in r)
    # the trackers agree with metrics.jsonl. W&B: its own step only grows, one per row logged (replays included);
    # the last row of each training step is metrics.jsonl's row of that step
    (record,) = list((cfg.run_dir / "wandb").rglob("*.wandb"))
    history = wandb_history(record)
    assert [h["_step"] for h in history] == list(range(len(history))) and [h["step"] for h in history] == seen
    last = {h["step"]: h for h in history}
    for r in rows:
        assert {k: last[r["step"]][k] for k, v in r.items() if v is not None} == pytest.approx(
            {k: v for k, v in r.items() if v is not None}), r["step"]
    # TensorBoard: the dead run's events of steps 1-2 and 5-6 are purged; each step once, metrics.jsonl's value
    assert tensorboard_scalars(cfg.run_dir / "tensorboard", "train/version") == {
        r["step"]: r["train/version"] for r in rows}
    assert tensorboard_scalars(cfg.run_dir / "tensorboard", "train/loss") == pytest.approx(
        {r["step"]: r["train/loss"] for r in rows})
    final = torch.load(summary.checkpoint / "trainer" / "rank_0.pt", weights_only=True)
    assert final["version"] == 8 and final["optimizer"]["params"]  # the Adam state of the distributed optimizer
    assert json.loads((summary.checkpoint / "trainer" / "meta.json").read_text())["distributed_optimizer"] is True
    assert all(torch.isfinite(t).all() for t in final["model"].values() if torch.is_tensor(t))


def poison_next_step(coord) -> None:
    """Fault injection: the trainer's next step sees a NaN advantage (a non-finite loss), so it is skipped."""
    def install(self):
        original = self._micro_step

        def once(micro, *args, **kwargs):
            self._micro_step = original
            micro.batch.adv[:] = float("nan")
            return original(micro, *args, **kwargs)
        self._micro_step = once
    ray.get(coord.trainer.workers[0].__ray_call__.remote(install))


def test_skipped_step_budget_spent_and_a_broken_checkpoint(tmp_path, caplog):
    """Three faults in one job. A skipped (non-finite) step keeps the policy version, and the loop follows the
    trainer's version, so checkpoints after it stay consistent (before: the loop bumped its version anyway and every
    later checkpoint was refused on --resume). With the restart budget spent, a trainer death stops the job with its
    checkpoints intact. `--resume` then passes over a newest checkpoint whose rank file was truncated (a crash
    mid-write) and continues from the one before (before: EOFError from torch.load, `Aborted.` in the command)."""
    def cfg(steps):
        return _cfg(tmp_path, f"coordinator.steps={steps}", "coordinator.checkpoint_every=1", "trainer.max_restarts=0",
                    "name=norestart", "coordinator.mode=sync", "algorithm.eps=fixed",
                    "coordinator.keep_checkpoints=2")

    def faults(coord, step):
        if step == 1:
            poison_next_step(coord)  # step 2 is skipped
        if step == 3:
            os.kill(trainer_pid(coord), signal.SIGKILL)

    with pytest.raises(TrainerFailed, match="step_000003"):
        run_job(cfg(4), after_step=faults)
    root = tmp_path / "norestart" / "checkpoints"
    rank_file = root / "step_000003" / "trainer" / "rank_0.pt"
    rank_file.write_bytes(rank_file.read_bytes()[: rank_file.stat().st_size // 2])
    with caplog.at_level(logging.WARNING):
        summary = run_job(cfg(4), resume=True)  # from step 2's checkpoint: the one written after the skipped step
    assert "step_000003" in caplog.text and "rank_0.pt" in caplog.text  # the broken one is named
    assert summary.steps == 4
    lines = [json.loads(ln) for ln in (tmp_path / "norestart" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 3, 4]  # step 3 redone from step 2's state
    assert [r["train/skipped_steps"] for r in lines][:2] == [0, 1]
    assert [r["train/version"] for r in lines] == [1, 1, 2, 2, 3]  # the skipped step did not move the version
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000003", "step_000004"]  # retention: the 2 newest
