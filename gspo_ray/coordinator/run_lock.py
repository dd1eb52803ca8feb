"""One live job per run directory: a lock file `run_dir/.gspo-ray.lock` held as a lease.

The file (JSON, mode 0600: pid, host, process start time, lock and renewal times, the lease, the command line with
secret values redacted) is created whole (written to a temp file, then hard-linked into place: never empty), renewed
by the job at every step boundary (`RunLock.refresh`) and every `HEARTBEAT_S` by a thread of the holding process
(start-up, long saves and in-job recovery included), and removed when the job ends. A renewal is a
compare-and-replace under the takeover mutex: a taker cannot rename its lock between the renewal's read and its
replace, and a renewal that finds another job's lock raises (RunLockError) instead of overwriting it.

Two jobs on one run directory would prune each other's in-flight checkpoints, interleave metrics, and `--fresh`
would delete a live run's checkpoints. A second job is refused (RunLockError, exit 2 in the CLI) while the holder
is alive:
  - on this host: its pid runs and started when the lock says (pid reuse is seen);
  - on another host (a new KubeRay head pod, a Slurm requeue on another node): its lease has not expired. The lease
    is `START_LEASE_S` until the first step boundary, then `LEASE_STEPS` times the longest interval between two
    renewals seen so far (a step with its evaluation and checkpoint), at least `LEASE_FLOOR_S`.
A stale lock is taken over with a warning: its content is read, judged, read again, and only if unchanged a whole
new lock is renamed over it (atomic), then read back to confirm; a holder that renewed in between keeps it.

    with RunLock(run_dir) as lock:  # before --fresh deletes anything
        ...
        lock.refresh()              # each step boundary
"""
from __future__ import annotations

import errno
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from gspo_ray.config.secrets import redact_args

log = logging.getLogger(__name__)

LOCK_NAME = ".gspo-ray.lock"
HELD: set[Path] = set()  # lock files this process holds (its own job's checks pass them)
START_LEASE_S = 1800.0  # until the first step boundary: pools of a big model can take many minutes to start
LEASE_STEPS = 5  # the lease after that: 5 x the longest renewal interval seen (a step + its eval and save) ...
LEASE_FLOOR_S = 300.0  # ... and never less than 5 minutes
UNREADABLE_GRACE_S = LEASE_FLOOR_S  # a lock file that does not parse (written by hand?) is stale after this long
TAKEOVER_STALE_S = 10.0  # a takeover file older than this was left by a taker that died mid-takeover
HEARTBEAT_S = 60.0  # the holder's thread renews the lease this often, whatever the job is doing (<< LEASE_FLOOR_S)


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


def _read_raw(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _parse(raw: bytes | None) -> dict | None:
    """The holder; {} for a file that does not parse."""
    if raw is None:
        return None
    try:
        holder = json.loads(raw)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def read_lock(run_dir: Path) -> dict | None:
    """The lock's holder, or None without a lock; a file that does not parse reads as {}."""
    return _parse(_read_raw(lock_path(run_dir)))


def holder_alive(holder: dict) -> bool | None:
    """True: the holder runs (on this host); False: it is gone; None: it is on another host (see its lease)."""
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


def lease_left(holder: dict, now: float | None = None) -> tuple[float, float]:
    """(seconds since the lease was last renewed, seconds it has left; <= 0: expired)."""
    now = time.time() if now is None else now
    renewed = holder.get("renewed_at", holder.get("locked_at", 0.0))
    lease = holder.get("lease_s", START_LEASE_S)
    renewed = renewed if isinstance(renewed, (int, float)) else 0.0
    lease = lease if isinstance(lease, (int, float)) else START_LEASE_S
    return now - renewed, renewed + lease - now


def describe(holder: dict) -> str:
    age, left = lease_left(holder)
    state = f"expires in {left:.0f} s" if left > 0 else f"expired {-left:.0f} s ago"
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, lease renewed {age:.0f} s ago "
            f"({state})")


def _judge(run_dir: Path, holder: dict | None, mtime: float | None) -> str | None:
    """Raise RunLockError when the holder is live; else a description of the stale lock (None: no lock)."""
    path = lock_path(run_dir)
    if holder is None:
        return None
    if holder == {}:
        age = time.time() - (mtime or 0.0)
        if age < UNREADABLE_GRACE_S:
            raise RunLockError(f"{run_dir}: its lock file {path} does not parse and was written {age:.0f} s ago; "
                               f"if no job uses this run directory, delete it")
        return f"an unreadable lock file, {age:.0f} s old"
    alive = holder_alive(holder)
    if alive and holder.get("pid") == os.getpid():
        raise RunLockError(f"{run_dir} is in use by a job in this process ({path})")
    if alive:
        raise RunLockError(f"{run_dir} is in use by another job ({describe(holder)}): stop it first, or give this "
                           "run another name or logging.out_dir")
    if alive is None and lease_left(holder)[1] > 0:
        raise RunLockError(f"{run_dir} is locked by a job on another host ({describe(holder)}); wait for the "
                           f"lease to expire, or if that job is surely gone, delete {path}")
    return describe(holder) + (" (its process is gone)" if alive is False else "")


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def check_unlocked(run_dir: Path) -> None:
    """Raise RunLockError when a live job (or one on another host with a live lease) holds the run directory;
    read-only."""
    path = lock_path(run_dir)
    if path.resolve() in HELD:
        return
    _judge(Path(run_dir), read_lock(run_dir), _mtime(path))


def _write_private(path: Path, data: bytes) -> None:
    """A whole file, mode 0600 (the lock holds who runs the job and how), on disk before it is linked or renamed."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class RunLock:
    """The run directory's lock for this process. `acquire()` raises RunLockError when another job holds it."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = lock_path(run_dir)
        self.held = False
        self._record: dict = {}
        self._renewed: float | None = None  # monotonic time of the last step-boundary renewal
        self._longest: float | None = None  # the longest interval between two step-boundary renewals
        self._renewals = 0
        self._write_lock = threading.Lock()  # the heartbeat and the step boundary never renew at once
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._lost: RunLockError | None = None  # the heartbeat found the lock taken over: refresh raises it

    def _temp(self) -> Path:
        return self.path.with_name(f"{LOCK_NAME}.tmp-{uuid.uuid4().hex[:8]}")

    def _data(self) -> bytes:
        return json.dumps(self._record).encode()

    def acquire(self) -> "RunLock":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self._record = {"pid": os.getpid(), "host": socket.gethostname(), "pid_start": process_start_time(os.getpid()),
                        "locked_at": now, "renewed_at": now, "lease_s": START_LEASE_S, "owner": uuid.uuid4().hex,
                        "argv": redact_args(sys.argv)}
        if self.path.resolve() in HELD:
            raise RunLockError(f"{self.run_dir} is in use by a job in this process ({self.path})")
        data = self._data()
        for _ in range(5):  # a stale lock is replaced; another job may win that race, then it is judged again
            if self._create(data):
                return self._hold()
            raw = _read_raw(self.path)
            stale = _judge(self.run_dir, _parse(raw), _mtime(self.path))  # raises for a live holder
            if stale is None:
                continue  # gone in between: create again
            if self._replace(raw, data):
                log.warning("%s: took over a stale lock (%s)", self.path, stale)
                return self._hold()
        raise RunLockError(f"{self.path}: could not take the run directory's lock (another job keeps taking it)")

    def _create(self, data: bytes, path: Path | None = None) -> bool:
        """Create the lock (or `path`) whole: a temp file hard-linked into place (fails if it exists). False: one
        exists."""
        path = self.path if path is None else path
        tmp = self._temp()
        _write_private(tmp, data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError as e:  # a filesystem without hard links: an exclusive create (written at once)
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            try:
                _write_private(path, data)
                return True
            except FileExistsError:
                return False
        finally:
            tmp.unlink(missing_ok=True)

    def _mutex(self, data: bytes) -> Path | None:
        """Take the takeover mutex (a file created like the lock): the path to unlink, or None when another job
        holds it now (one that died leaves it: after TAKEOVER_STALE_S it is removed)."""
        mutex = self.path.with_name(self.path.name + ".takeover")
        if self._create(data, mutex):
            return mutex
        age = _mtime(mutex)
        if age is not None and time.time() - age > TAKEOVER_STALE_S:
            mutex.unlink(missing_ok=True)
        time.sleep(0.05)
        return None

    def _replace(self, stale_raw: bytes | None, data: bytes) -> bool:
        """Rename a whole new lock over the stale one if the file still holds what was judged. One taker at a
        time (the mutex): two takers that both read the stale lock before either renamed would otherwise both
        rename, and both read their own lock back. False: judge again."""
        mutex = self._mutex(data)
        if mutex is None:
            return False
        tmp = self._temp()
        _write_private(tmp, data)
        try:
            if _read_raw(self.path) != stale_raw:  # renewed, released or taken meanwhile: judge again
                return False
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
            mutex.unlink(missing_ok=True)
        return _read_raw(self.path) == data

    def _hold(self) -> "RunLock":
        self.held = True
        self._renewed = time.monotonic()
        HELD.add(self.path.resolve())
        self._stop.clear()
        self._heartbeat = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._heartbeat.start()
        return self

    def _beat(self) -> None:
        """Renew every HEARTBEAT_S until released: a start-up, save or recovery longer than the lease never lets
        a job on another host take a live run directory. Stops when the lock was taken over (refresh raises)."""
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._renew()
            except RunLockError as e:
                self._lost = e
                return
            except OSError as e:  # a full disk or a storage hiccup: the next beat or boundary tries again
                log.warning("%s: could not renew the lease (%s); trying again", self.path, e)

    def _renew(self) -> None:
        """Write the record with `renewed_at` now, compare-and-replace: under the takeover mutex, only over a
        file that still holds this job's lock. Raises RunLockError when another job took it over."""
        with self._write_lock:
            self._record["renewed_at"] = time.time()
            data = self._data()
            for _ in range(int(4 * TAKEOVER_STALE_S / 0.05)):  # a taker holds the mutex for milliseconds
                mutex = self._mutex(data)
                if mutex is not None:
                    break
            else:
                raise RunLockError(f"{self.path}: could not renew the lease (the takeover mutex stays taken)")
            tmp = self._temp()
            try:
                holder = read_lock(self.run_dir)
                if not holder or holder.get("owner") != self._record["owner"]:
                    raise RunLockError(f"{self.path}: this job's lock was taken over by another job "
                                       f"({describe(holder) if holder else 'the lock file is gone'}); stopping")
                _write_private(tmp, data)
                os.replace(tmp, self.path)
            finally:
                tmp.unlink(missing_ok=True)
                mutex.unlink(missing_ok=True)

    def refresh(self) -> None:
        """Renew the lease (each step boundary): now, for `LEASE_STEPS` x the longest interval between renewals
        (at least `LEASE_FLOOR_S`). Raises RunLockError when another job took the lock over (this job's lease had
        expired): two jobs must never write one run directory."""
        if not self.held:
            return
        if self._lost is not None:
            raise self._lost
        mono = time.monotonic()
        if self._renewals:  # the interval since the previous renewal; not the start-up before the first one
            self._longest = max(self._longest or 0.0, mono - self._renewed)
        if self._longest is not None:
            with self._write_lock:
                self._record["lease_s"] = max(LEASE_FLOOR_S, LEASE_STEPS * self._longest)
        self._renew()
        self._renewed = mono
        self._renewals += 1

    def release(self) -> None:
        """Remove the lock if it is still ours (never another job's that took over a lock we lost)."""
        if not self.held:
            return
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        HELD.discard(self.path.resolve())
        holder = read_lock(self.run_dir)
        if holder and holder.get("owner") == self._record.get("owner"):
            self.path.unlink(missing_ok=True)
        self.held = False

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
