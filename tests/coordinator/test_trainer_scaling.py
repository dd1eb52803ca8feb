"""gspo-ray scale trainer 2, then 1, on a running job: each resize checkpoints at a step boundary, rebuilds the
trainer pool at the new data-parallel size and reloads it; step counter, policy version, weights and optimizer
state carry over exactly (at DP 2 with the distributed optimizer, its default there). Then `scale trainer 4` on
the full cluster: the command waits for the job's answer and exits 1 with the job's reason; the pool stays as it
is."""
import json
import math
import subprocess
import sys
import time

import pytest
import ray
import torch

from gspo_ray.config import load_config
from gspo_ray.coordinator.control import control_actor_name
from gspo_ray.coordinator.job import run_job
from gspo_ray.coordinator.tracking import read_metrics
from gspo_ray.trainer import checkpoint as ckpt
from gspo_ray.trainer.shards import full_state

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]  # 3 CPUs: 2 trainer ranks + 1 rollout
RECIPE = "gspo_ray/recipes/tiny_moe.yaml"


def same(a, b, where="") -> None:
    """Nested payloads equal exactly (tensors bit for bit)."""
    if torch.is_tensor(a):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")


def read(ckpt_dir, rank):
    return ckpt.load_rank_payload(ckpt_dir, rank, mmap=True)


def test_scale_trainer_pool_live(tmp_path):
    cfg = load_config(RECIPE, [f"logging.out_dir={tmp_path}", "logging.progress=false", "logging.plot=false",
                               "logging.tensorboard=false", "coordinator.steps=5", "coordinator.eval_every=0",
                               "coordinator.checkpoint_every=0", "data.num_eval=0", "name=tscaling",
                               "coordinator.mode=sync", "algorithm.eps=fixed"])
    address = ray.get_runtime_context().gcs_address
    seen = []

    def hook(coord, step):
        if step in (1, 3):  # requested after step 1 (3): applied at the end of step 2 (4)
            size = 2 if step == 1 else 1
            # --no-wait: the job applies the request only once this hook returns
            out = subprocess.run([sys.executable, "-m", "gspo_ray.cli", "scale", "trainer", str(size), "--job",
                                  "tscaling", "--address", address, "--no-wait"], capture_output=True, text=True,
                                 timeout=120)
            assert out.returncode == 0, out.stderr
        if step in (2, 4):  # just resized: the new pool holds exactly what the old one saved at this boundary
            seen.append(coord.trainer.num_workers)
            assert coord.trainer.version() == coord.state.version == step
            after = tmp_path / f"after_{step}"
            coord.trainer.save(after)
            saved = cfg.run_dir / "checkpoints" / f"step_{step:06d}" / "trainer"
            # the whole model and Adam state, read in one layout from the old pool's save and the new pool's
            same(full_state(saved, coord.trainer.model_path, read), full_state(after, coord.trainer.model_path, read))
            # DP 2 runs the distributed optimizer (the default above DP 1), DP 1 the plain one
            assert json.loads((after / "meta.json").read_text())["distributed_optimizer"] == (step == 2)
            before = ckpt.load_rank_payload(saved, 0)
            for rank in range(coord.trainer.num_workers):
                now = ckpt.load_rank_payload(after, rank)
                assert before["scheduler"] == now["scheduler"] and now["version"] == step
        if step == 4:  # 4 ranks of 1 CPU on 3 CPUs: refused at the end of step 5; the command waits for that
            refused.append(subprocess.Popen([sys.executable, "-m", "gspo_ray.cli", "scale", "trainer", "4", "--job",
                                             "tscaling", "--address", address], stderr=subprocess.PIPE, text=True))
            control = ray.get_actor(control_actor_name("tscaling"), namespace=cfg.cluster.namespace)
            deadline = time.monotonic() + 60
            while "trainer_workers" not in ray.get(control.pending.remote()):  # queued before step 5's boundary
                assert refused[0].poll() is None and time.monotonic() < deadline, refused[0].stderr.read()
                time.sleep(0.2)

    refused = []
    run_job(cfg, after_step=hook)
    _, err = refused[0].communicate(timeout=60)
    assert refused[0].returncode == 1 and "scale trainer 4 refused: the cluster has no room" in err, err
    assert seen == [2, 1]
    rows = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["trainer/workers"] for r in rows] == [1, 2, 2, 1, 1]   # size after each step's control check
    assert [r["train/version"] for r in rows] == [1, 2, 3, 4, 5]     # one optimizer step a step, across resizes
    assert [r.get("job/trainer_workers") for r in rows] == [None, 2, None, 1, None]
    assert [r.get("job/trainer_scale_refused") for r in rows] == [None] * 4 + [1.0]
    # the push after each resize re-homes the live weights; the engines' log-probs still match the trainer's
    assert all(rows[i]["sync/verify_max_abs_diff"] <= 1e-4 for i in (1, 3))
    assert all(math.isfinite(r["train/loss"]) for r in rows)
