"""Node failure on a multi-node cluster on one machine: the node hosting the rollout worker is lost in the middle of
a batch, then the node hosting the trainer; replacement nodes join (as an autoscaler would add them) and the job
finishes every step, each once, with nothing lost or duplicated.

Nodes (each its own raylet, `cluster/local_cluster.py`): the head (no CPUs: the driver and the control actor),
worker0 (`rollout_node`), worker1 (`trainer_node`). A node is lost by SIGKILL of its whole process tree.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gspo_ray.coordinator.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from cluster.local_cluster import LocalCluster  # noqa: E402

pytestmark = pytest.mark.slow


def serve_kills(cluster: LocalCluster, events: Path, driver: subprocess.Popen, timeout_s: float = 600) -> list:
    """Once the pools are placed, add a spare node for each pool (as an autoscaler keeps one); then kill the node
    named by each request of the driver and answer it."""
    served, spares, spared = [], {"rollout": {"rollout_node": 1}, "trainer": {"trainer_node": 1}}, False
    deadline = time.monotonic() + timeout_s
    while driver.poll() is None and time.monotonic() < deadline and len(served) < len(spares):
        if not spared and (events / "pools_up").exists():
            for resources in spares.values():
                cluster.add_worker(cpus=1, resources=resources)
            spared = True
        for what in spares if spared else ():
            request, done = events / f"kill_{what}.json", events / f"kill_{what}.done"
            if request.exists() and not done.exists():
                victim = cluster.node_hosting(json.loads(request.read_text())["pid"])
                cluster.kill_node(victim)
                served.append((what, victim))
                done.write_text("ok")
        time.sleep(0.2)
    return served


def test_losing_the_rollout_node_then_the_trainer_node_loses_nothing(tmp_path):
    events = tmp_path / "events"
    events.mkdir()
    overrides = [f"logging.out_dir={tmp_path}", "logging.progress=false", "logging.plot=false",
                 "logging.tensorboard=false", "logging.export_hf=none", "coordinator.steps=8",
                 "coordinator.checkpoint_every=4", "coordinator.eval_every=0", "data.num_eval=0", "name=nodeloss",
                 "rollout.num_workers=1", "rollout.resources={rollout_node: 1}", "trainer.resources={trainer_node: 1}"]
    # a lost node is declared dead after ~8 s of missed health checks (Ray's default: 15-25 s)
    with LocalCluster(num_worker_nodes=0, head_cpus=0, base_dir=tmp_path / "ray", node_death_s=8) as cluster:
        cluster.add_worker(cpus=1, resources={"rollout_node": 1})
        cluster.add_worker(cpus=1, resources={"trainer_node": 1})
        driver = subprocess.Popen([sys.executable, str(ROOT / "tests/cluster/_node_failure_job.py"), cluster.address,
                                   str(events), *overrides], cwd=ROOT, env=dict(os.environ), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            served = serve_kills(cluster, events, driver)
            out, _ = driver.communicate(timeout=600)
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait()
    assert driver.returncode == 0, out[-6000:]
    assert served == [("rollout", "worker0"), ("trainer", "worker1")]
    summary = json.loads(next(line for line in out.splitlines() if line.startswith("SUMMARY "))[8:])
    assert summary["steps"] == 8
    # the trainer node died after step 5: back to the step-4 checkpoint, step 5 replayed; the rollout loss rewinds
    # nothing (its prompts go to the replacement worker)
    assert summary["seen"] == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    rows = read_metrics(Path(summary["run_dir"]) / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))                 # each step once
    assert [r["train/version"] for r in rows] == list(range(1, 9))
    assert all(r["rollout/failed_samples"] == 0 for r in rows)            # nothing lost ...
    assert all(r["rollout/groups_trained"] == rows[0]["rollout/groups_trained"] for r in rows)  # ... or short
    # the batch the lost node was sampling (dispatched in step 2, awaited in step 3: all 16 prompts) went to the
    # replacement, once (a job total)
    assert [r["rollout/redispatched_prompts"] for r in rows] == [0, 0] + [16] * 6
    assert rows[-1]["rollout/worker_restarts"] == 1  # on the spare node
    assert [(r["step"], r["job/trainer_restarts"]) for r in rows if "job/trainer_restarts" in r] == [(5, 1)]
    assert all(r["sync/verify_max_abs_diff"] <= 1e-4 for r in rows if "sync/verify_max_abs_diff" in r)
