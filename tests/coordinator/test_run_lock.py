"""One live job per run directory: a second `train` on a live run is refused before it touches anything; a lock
left by a dead job is taken over; the lock is released when the job ends. Driven through the real `train`
command (its lock check runs before the preflight) and RunLock itself."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from gspo_ray.cli import app
from gspo_ray.coordinator.run_lock import LOCK_NAME, RunLock, RunLockError, read_lock

RECIPE = "gspo_ray/recipes/tiny_moe.yaml"


def _live_holder(run_dir):
    """A real other process that holds the run directory's lock (as a live job would) until killed."""
    code = ("import sys, time\nfrom gspo_ray.coordinator.run_lock import RunLock\n"
            "RunLock(sys.argv[1]).acquire()\nprint('locked', flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _snapshot(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("flag", ["--resume", "--fresh"])
def test_a_live_jobs_run_dir_is_refused_and_left_untouched(tmp_path, flag):
    run_dir = tmp_path / "tiny-moe-gspo"
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_000002" / "loop.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    holder = _live_holder(run_dir)
    try:
        before = _snapshot(run_dir)
        result = CliRunner().invoke(app, ["train", RECIPE, f"logging.out_dir={tmp_path}", flag])
        assert result.exit_code == 2, result.output
        lines = [ln for ln in result.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and f"pid {holder.pid}" in lines[0], lines
        assert _snapshot(run_dir) == before  # --fresh deleted nothing
        assert read_lock(run_dir)["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that was a job and is gone now
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                                  "pid_start": time.time() - 60, "locked_at": time.time() - 60}))
    with caplog.at_level("WARNING"):
        with RunLock(tmp_path) as lock:
            assert lock.held and read_lock(tmp_path)["pid"] == os.getpid()
    assert "stale lock" in caplog.text and str(dead.pid) in caplog.text
    assert not (tmp_path / LOCK_NAME).exists()  # released at exit


def test_a_reused_pid_does_not_keep_a_stale_lock(tmp_path):
    """The recorded pid is alive but is a different, younger process (pid reuse): the lock is stale."""
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                  "pid_start": 1.0, "locked_at": 1.0}))
    lock = RunLock(tmp_path).acquire()
    assert read_lock(tmp_path)["pid_start"] != 1.0
    lock.release()


def test_a_lock_from_another_host_is_refused_naming_it(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "other-node-7", "locked_at": time.time()}))
    with pytest.raises(RunLockError, match="other-node-7"):
        RunLock(tmp_path).acquire()
    assert read_lock(tmp_path)["host"] == "other-node-7"


def test_the_holder_is_refused_a_second_lock_and_releases_on_error(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with RunLock(tmp_path):
            with pytest.raises(RunLockError, match="in use"):
                RunLock(tmp_path).acquire()
            1 / 0
    assert read_lock(tmp_path) is None
