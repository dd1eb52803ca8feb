"""One live job per run directory: a second `train` on a live run is refused before it touches anything; a lock
left by a dead job, or by a job on another host whose lease expired, is taken over (by exactly one of several
racing jobs); the lock is renewed at step boundaries, is mode 0600, holds no secret, and is released when the job
ends. Driven through the real `train` command (its lock check runs before the preflight) and RunLock itself.
`--resume` over an expired lease of another host through a whole job: test_signals.py."""
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
from gspo_ray.coordinator import run_lock
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


def _other_host_lock(path, renewed_ago_s, lease_s=600.0):
    path.mkdir(parents=True, exist_ok=True)
    (path / LOCK_NAME).write_text(json.dumps({"pid": 4242, "host": "old-pod-abc", "locked_at": time.time() - 7200,
                                              "renewed_at": time.time() - renewed_ago_s, "lease_s": lease_s}))


def test_a_live_lease_from_another_host_is_refused_naming_host_pid_and_age(tmp_path):
    run_dir = tmp_path / "tiny-moe-gspo"
    _other_host_lock(run_dir, renewed_ago_s=42)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    result = CliRunner().invoke(app, ["train", RECIPE, f"logging.out_dir={tmp_path}", "--resume"])
    assert result.exit_code == 2, result.output
    (line,) = [ln for ln in result.output.splitlines() if ln.strip()]
    assert "pid 4242 on host old-pod-abc, lease renewed 42 s ago (expires in 558 s)" in line, line
    assert read_lock(run_dir)["host"] == "old-pod-abc"  # untouched


def test_an_expired_lease_from_another_host_is_taken_over(tmp_path, caplog):
    _other_host_lock(tmp_path, renewed_ago_s=3600)
    with caplog.at_level("WARNING"):
        with RunLock(tmp_path):
            holder = read_lock(tmp_path)
            assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    assert "old-pod-abc" in caplog.text and "expired" in caplog.text


def test_the_lock_is_private_whole_and_holds_no_secret(tmp_path, monkeypatch):
    secret = "hf_PLANTEDlock0123456789"
    monkeypatch.setattr(sys, "argv", ["gspo-ray", "train", "x.yaml", f"cluster.runtime_env.env_vars.HF_TOKEN={secret}",
                                      "--api-key", secret, f"data.url=https://me:{secret}@host/x", "rollout.n=8"])
    with RunLock(tmp_path):
        path = tmp_path / LOCK_NAME
        assert path.stat().st_mode & 0o777 == 0o600
        assert secret not in path.read_text()
        assert read_lock(tmp_path)["argv"][3:] == ["cluster.runtime_env.env_vars.HF_TOKEN=<redacted>", "--api-key",
                                                   "<redacted>", "data.url=https://<redacted>@host/x", "rollout.n=8"]
        assert not list(tmp_path.glob(f"{LOCK_NAME}.tmp-*"))  # the temp file it was linked from is gone


def test_the_lease_is_renewed_at_step_boundaries(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(run_lock.time, "monotonic", lambda: clock[0])
    with RunLock(tmp_path) as lock:
        assert read_lock(tmp_path)["lease_s"] == run_lock.START_LEASE_S  # start-up: no step time known yet
        clock[0] += 900  # pools started and the first step ran: not a step interval
        lock.refresh()
        assert read_lock(tmp_path)["lease_s"] == run_lock.START_LEASE_S
        clock[0] += 20  # a 20 s step: the floor
        lock.refresh()
        assert read_lock(tmp_path)["lease_s"] == run_lock.LEASE_FLOOR_S
        clock[0] += 100  # a 100 s step (with its save): 5 x 100 s
        lock.refresh()
        assert read_lock(tmp_path)["lease_s"] == run_lock.LEASE_STEPS * 100
        assert time.time() - read_lock(tmp_path)["renewed_at"] < 5


def test_a_job_whose_lock_was_taken_over_stops_at_its_next_boundary(tmp_path):
    with RunLock(tmp_path) as lock:
        _other_host_lock(tmp_path, renewed_ago_s=0)  # our lease expired and another host's job took it
        with pytest.raises(RunLockError, match="taken over"):
            lock.refresh()
    assert read_lock(tmp_path)["host"] == "old-pod-abc"  # never removed another job's lock


def test_a_renewal_never_overwrites_a_lock_taken_between_its_read_and_its_replace(tmp_path, monkeypatch):
    """R17: our lease looks expired to a job on another host, which takes the lock over exactly while our renewal
    runs (after its read, before its replace). Read-then-replace overwrote the taker's lock: both jobs held the
    run directory. Under the mutex the taker must wait, and is refused; or it wins first and the renewal raises."""
    with RunLock(tmp_path) as lock:
        path = tmp_path / LOCK_NAME
        # as another host sees us: a lease that expired an hour ago (same owner, so the renewal takes it as ours)
        path.write_text(json.dumps({**lock._record, "host": "old-pod-abc", "renewed_at": time.time() - 3600,
                                    "lease_s": 300}))
        taker, outcome, read_raw = RunLock(tmp_path), [], run_lock._read_raw

        def racing_read(p):
            raw = read_raw(p)
            if not outcome and p == path:  # the renewal's read: the other job strikes now
                outcome.append("racing")
                run_lock.HELD.discard(path.resolve())  # the taker plays another process
                try:
                    taker.acquire()
                    outcome.append("taken")
                except RunLockError:
                    outcome.append("refused")
                run_lock.HELD.add(path.resolve())
            return raw

        monkeypatch.setattr(run_lock, "_read_raw", racing_read)
        lock.refresh()
        assert outcome == ["racing", "refused"]  # read-then-replace: "taken", then overwritten
        assert read_lock(tmp_path)["owner"] == lock._record["owner"] and not taker.held


def test_the_lease_is_renewed_while_the_job_is_between_boundaries(tmp_path, monkeypatch):
    """A start-up, save or recovery longer than the lease: the holder's heartbeat renews it meanwhile; once the
    lock is taken over, the heartbeat stops and the next step boundary raises; release stops the thread."""
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    with RunLock(tmp_path) as lock:
        first = read_lock(tmp_path)["renewed_at"]
        deadline = time.time() + 10
        while read_lock(tmp_path)["renewed_at"] == first:  # no refresh() called: a long save is running
            assert time.time() < deadline, "the lease was not renewed between step boundaries"
            time.sleep(0.05)
        mutex = tmp_path / f"{LOCK_NAME}.takeover"
        while True:  # another host's job takes the lock over as takers do: under the mutex
            try:
                os.close(os.open(mutex, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
                break
            except FileExistsError:  # the heartbeat is renewing right now
                time.sleep(0.01)
        _other_host_lock(tmp_path, renewed_ago_s=0)
        mutex.unlink()
        while lock._heartbeat.is_alive():
            assert time.time() < deadline
            time.sleep(0.05)
        assert read_lock(tmp_path)["host"] == "old-pod-abc"  # the heartbeat never overwrote it
        with pytest.raises(RunLockError, match="taken over"):
            lock.refresh()
    assert read_lock(tmp_path)["host"] == "old-pod-abc"
    with RunLock(tmp_path / "b") as other:
        beat = other._heartbeat
    assert not beat.is_alive()


RACER = """import sys, time
from gspo_ray.coordinator.run_lock import RunLock, RunLockError
while time.time() < float(sys.argv[2]):  # start together
    time.sleep(0.001)
try:
    RunLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(5)
except RunLockError:
    print("refused", flush=True)
"""


def test_racing_takeovers_of_a_stale_lock_leave_one_holder(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                                  "pid_start": time.time() - 60, "locked_at": time.time() - 60}))
    start = str(time.time() + 3)
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path), start], stdout=subprocess.PIPE,
                               text=True) for _ in range(4)]
    outcomes = sorted(p.communicate(timeout=60)[0].strip() for p in racers)
    assert outcomes == ["held", "refused", "refused", "refused"], outcomes


def test_the_holder_is_refused_a_second_lock_and_releases_on_error(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with RunLock(tmp_path):
            with pytest.raises(RunLockError, match="in use"):
                RunLock(tmp_path).acquire()
            1 / 0
    assert read_lock(tmp_path) is None
