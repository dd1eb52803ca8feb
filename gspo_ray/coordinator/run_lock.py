"""One live job per run directory: a lock file `run_dir/.gspo-ray.lock` (JSON: pid, host, process start time,
lock time, command line), created atomically, held for the job's life and removed when it ends.

Two jobs on one run directory would prune each other's in-flight checkpoints, interleave metrics, and `--fresh`
would delete a live run's checkpoints. A second job is refused (RunLockError, exit 2 in the CLI). A stale lock
(its pid is gone on this host, or the pid now belongs to a younger process) is taken over with a warning. A lock
written on another host cannot be checked from here and is refused, naming the host and the file to delete.

    with RunLock(run_dir):          # before --fresh deletes anything
        ...
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path


log = logging.getLogger(__name__)

LOCK_NAME = ".gspo-ray.lock"
HELD: set[Path] = set()  # lock files this process holds (its own job's checks pass them)


class RunLockError(ValueError):
    """Another live job holds the run directory."""


def lock_path(run_dir: Path) -> Path:
    return Path(run_dir) / LOCK_NAME


def process_start_time(pid: int) -> float | None:
    """The process's start time (seconds since the epoch), None when no such process exists."""
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # psutil.NoSuchProcess, AccessDenied: treat as gone only if the pid is really free
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return 0.0  # alive, another user's process
        return 0.0


def read_lock(run_dir: Path) -> dict | None:
    """The lock's holder, or None without a lock; an unreadable lock file reads as {} (treated as stale)."""
    path = lock_path(run_dir)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def holder_alive(holder: dict) -> bool | None:
    """True: the holder runs (on this host); False: it is gone; None: it is on another host (unknown)."""
    if holder.get("host") != socket.gethostname():
        return None
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    started = process_start_time(pid)
    if started is None:
        return False
    # the pid was reused by a process that started after the lock was written: the holder is gone
    recorded = holder.get("pid_start")
    return not (isinstance(recorded, (int, float)) and started and abs(started - recorded) > 1.0)


def describe(holder: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("locked_at", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')}, since {when}"


def check_unlocked(run_dir: Path) -> None:
    """Raise RunLockError when a live job (or one on another host) holds the run directory; read-only."""
    holder = read_lock(run_dir)
    if holder is None or holder == {} or lock_path(run_dir).resolve() in HELD:
        return
    alive = holder_alive(holder)
    if alive and holder.get("pid") == os.getpid():
        raise RunLockError(f"{run_dir} is in use by a job in this process ({lock_path(run_dir)})")
    if alive:
        raise RunLockError(f"{run_dir} is in use by another job ({describe(holder)}): stop it first, or give this "
                           "run another name or logging.out_dir")
    if alive is None:
        raise RunLockError(f"{run_dir} is locked by a job on host {holder.get('host')} ({describe(holder)}); "
                           f"if that job is gone, delete {lock_path(run_dir)}")


class RunLock:
    """The run directory's lock for this process. `acquire()` raises RunLockError when another job holds it."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = lock_path(run_dir)
        self.held = False

    def acquire(self) -> "RunLock":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "pid_start": process_start_time(os.getpid()),
              "locked_at": time.time(), "argv": sys.argv}
        for _ in range(3):  # a stale lock is removed, then the create is retried (another job may win the race)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if self.path.resolve() in HELD:
                    raise RunLockError(f"{self.run_dir} is in use by a job in this process ({self.path})") from None
                check_unlocked(self.run_dir)  # raises for a live holder
                holder = read_lock(self.run_dir) or {}
                log.warning("%s: taking over a stale lock (%s is no longer running)", self.path,
                            describe(holder) if holder else "unreadable lock file")
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            HELD.add(self.path.resolve())
            return self
        raise RunLockError(f"{self.path}: could not take the run directory's lock (another job keeps taking it)")

    def release(self) -> None:
        """Remove the lock if it is still ours (never another job's that took over a lock we lost)."""
        if not self.held:
            return
        HELD.discard(self.path.resolve())
        holder = read_lock(self.run_dir)
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)
        self.held = False

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
