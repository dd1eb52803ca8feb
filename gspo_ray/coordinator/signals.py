"""SIGTERM / SIGINT in the job driver: a request to stop at the next step boundary, not an abort.

`gspo-ray stop` (Ray Job Submission), Slurm's `scancel --signal=TERM` and a scheduler's TERM send SIGTERM; Ctrl-C
sends SIGINT. Ray's driver otherwise dies on SIGTERM with a C++ stack trace (exit 134) and nothing since the last
checkpoint is kept. With a `StopRequest` installed, the first signal only sets a flag; the loop ends the step it
is in (a signal during start-up: before step 1), saves a checkpoint, the job flushes its trackers and shuts its
pools down, and `gspo-ray train` exits 128 + the signal number (143 for SIGTERM, 130 for SIGINT) with one line
naming the checkpoint `--resume` continues from (`resume_line`). A second signal stops at once
(`StopRequested(immediate=True)`: nothing more is saved, the last complete checkpoint is the resume point) with
the same exit code and line; signals while the pools shut down (`quiet()`) are noted and change nothing.

    stop = StopRequest().install()          # again after ray.init, which installs its own SIGTERM handler
    after_step = stop.check_after(after_step)  # raises StopRequested at a step boundary once a signal came
    ...
    stop.restore()
"""
from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopRequested(KeyboardInterrupt):
    """Raised at a step boundary after SIGTERM/SIGINT (or at once on the second signal: `immediate`). A
    KeyboardInterrupt, so the loop's interrupt path (save the finished step, report `interrupted`) handles it the
    same way as Ctrl-C. `signum` is the first signal's: the reason the job stops, and its exit code."""

    def __init__(self, signum: int, immediate: bool = False):
        super().__init__(f"stop requested by {signal.Signals(signum).name}" + (" (at once)" if immediate else ""))
        self.signum = signum
        self.immediate = immediate


def exit_code_for(signum: int | None) -> int:
    """The shell convention for a process ended by a signal: 128 + its number (SIGTERM 143, SIGINT 130)."""
    return 128 + (signum if signum is not None else signal.SIGINT)


class StopRequest:
    """The driver's signal handlers and the stop they request."""

    def __init__(self):
        self.signum: int | None = None
        self.forced = False  # a second signal came: stopping at once
        self._quiet = False
        self._previous: dict[int, object] = {}

    def install(self) -> "StopRequest":
        """Handle SIGTERM and SIGINT in this process (main thread only: Python delivers signals there; from any
        other thread this is a no-op and the process keeps its handlers). Called again, it takes the signals back
        from whoever set handlers since (ray.init) and keeps the handlers found the first time for `restore`."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("not on the main thread: SIGTERM/SIGINT keep their default handling")
            return self
        for sig in HANDLED:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)
        return self

    def restore(self) -> None:
        """Put back the handlers found at install (a test process, or a caller that runs several jobs)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """Inside: a signal is recorded (the exit code) but raises nothing, so a shutdown in progress is not cut
        half-way (pools, trackers, Ray)."""
        self._quiet, before = True, self._quiet
        try:
            yield
        finally:
            self._quiet = before

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        # stderr through logging: a handler must not block, and a print could interleave with the progress bar
        if self.signum is None:
            self.signum = signum
            if self._quiet:
                log.warning("%s received while shutting down: stopping once that is done", name)
            else:
                log.warning("%s received: finishing this step, then saving a checkpoint and stopping (send it "
                            "again to stop at once)", name)
            return
        if self.forced or self._quiet:
            log.warning("%s again: already stopping", name)
            return
        self.forced = True  # the user (or the scheduler) does not want to wait
        log.warning("%s again: stopping now, saving nothing more", name)
        raise StopRequested(self.signum, immediate=True)

    def raise_if_requested(self) -> None:
        if self.signum is not None:
            raise StopRequested(self.signum, immediate=self.forced)

    def check_after(self, after_step=None):
        """Wrap the job's `after_step(coord, step)` hook so a pending stop is raised at the step boundary (after
        the step's metrics and any scheduled checkpoint are written)."""
        def hook(coord, step):
            if after_step is not None:
                after_step(coord, step)
            self.raise_if_requested()
        return hook


@contextmanager
def signals_seen() -> Iterator[set[int]]:
    """The numbers of the signals delivered to this process inside the block, whichever Python handler ran (or
    swallowed them): read from the interpreter's wakeup fd, written by its C-level handler. ray.init installs a
    SIGTERM handler (`sys.exit`) and forks; a SystemExit raised in a fork hook is printed as "Exception ignored" and
    lost, so the job would go on without this record. Main thread only (else an empty set)."""
    import socket

    seen: set[int] = set()
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    r, w = socket.socketpair()
    r.setblocking(False)
    w.setblocking(False)
    old = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
    try:
        yield seen
    finally:
        signal.set_wakeup_fd(old)
        try:
            while data := r.recv(4096):
                seen.update(data)
        except (BlockingIOError, InterruptedError):
            pass
        r.close()
        w.close()


def resume_line(run_dir: Path, signum: int) -> str:
    """The one line `gspo-ray train` prints when a signal stopped it: the checkpoint `--resume` continues from."""
    from gspo_ray.coordinator.checkpoint import CheckpointManager

    name = signal.Signals(signum).name
    try:
        point = CheckpointManager(run_dir).resume_point()
    except Exception as e:  # noqa: BLE001 - an unreadable checkpoints directory: say so, keep the exit code
        return f"stopped by {name}: the resume point could not be read ({e})"
    if point is None:
        again = "--fresh" if (Path(run_dir) / "metrics.jsonl").exists() else "--resume"
        return f"stopped by {name}: no checkpoint yet (the run starts from step 0 again with {again})"
    step = int(point.name.split("_")[1])
    return f"stopped by {name}: resume point {point} (step {step}; continue with --resume)"
