"""SIGTERM / SIGINT in the job driver: a request to stop at the next step boundary, not an abort.

`gspo-ray stop` (Ray Job Submission), Slurm's `scancel` and Kubernetes' pod deletion send SIGTERM; Ctrl-C sends
SIGINT. Ray's driver otherwise dies on SIGTERM with a C++ stack trace (exit 134) and nothing since the last
checkpoint is kept. With a `StopRequest` installed, the first signal only sets a flag; the loop ends the step it
is in, saves a checkpoint, the job flushes its trackers and shuts its pools down, and `gspo-ray train` exits
128 + the signal number (143 for SIGTERM, 130 for SIGINT). A second signal stops at once (KeyboardInterrupt):
the last checkpoint stays the resume point.

    stop = StopRequest().install()          # after ray.init, which installs its own SIGTERM handler
    after_step = stop.check_after(after_step)  # raises StopRequested at a step boundary once a signal came
    ...
    stop.restore()
"""
from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopRequested(KeyboardInterrupt):
    """Raised at a step boundary after SIGTERM/SIGINT. A KeyboardInterrupt, so the loop's interrupt path (save the
    finished step, report `interrupted`) handles it the same way as Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(f"stop requested by {signal.Signals(signum).name}")
        self.signum = signum


def exit_code_for(signum: int | None) -> int:
    """The shell convention for a process ended by a signal: 128 + its number (SIGTERM 143, SIGINT 130)."""
    return 128 + (signum if signum is not None else signal.SIGINT)


class StopRequest:
    """The driver's signal handlers and the stop they request."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> "StopRequest":
        """Handle SIGTERM and SIGINT in this process (main thread only: Python delivers signals there; from any
        other thread this is a no-op and the process keeps its handlers)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("not on the main thread: SIGTERM/SIGINT keep their default handling")
            return self
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Put back the handlers found at install (a test process, or a caller that runs several jobs)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:  # the second signal: the user (or the scheduler) does not want to wait
            log.warning("%s again: stopping now; the last checkpoint is the resume point",
                        signal.Signals(signum).name)
            raise KeyboardInterrupt
        self.signum = signum
        # stderr through logging: a handler must not block, and a print could interleave with the progress bar
        log.warning("%s received: finishing this step, then saving a checkpoint and stopping (send it again to "
                    "stop at once)", signal.Signals(signum).name)

    def raise_if_requested(self) -> None:
        if self.signum is not None:
            raise StopRequested(self.signum)

    def check_after(self, after_step=None):
        """Wrap the job's `after_step(coord, step)` hook so a pending stop is raised at the step boundary (after
        the step's metrics and any scheduled checkpoint are written)."""
        def hook(coord, step):
            if after_step is not None:
                after_step(coord, step)
            self.raise_if_requested()
        return hook
