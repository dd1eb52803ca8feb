"""What keeps an nccl / ipc push bounded on the trainer side (`rollout.push_timeout_s`, trainer/weights/weight_send.py).

    send_bounded(sender.send_weights, lambda: client.fault, sender.shutdown, timeout_s)   # trainer rank 0
    gate = PushGate.create(rank, timeout_s); gate.begin(); ...; gate.pass_through(); ...; gate.end()   # every rank

`send_bounded`: vLLM's nccl sender broadcasts on its calling thread while the engines' `update_weights` runs on a
side thread whose error it reads only after the broadcast; a broadcast whose peer died never returns (no timeout
in vLLM's `PyNcclCommunicator`). So rank 0 runs the push on a thread of its own and watches: the client's first
engine fault (an engine dead, its call raised, or no answer in the client's timeout) or the bound passing aborts
the sender (vLLM's `shutdown`: `ncclCommAbort` of its group, which ends the pending broadcast with an error) and
raises at once; the pushing thread is given ABORT_GRACE_S to unwind and is otherwise left behind (a daemon).

`PushGate`: the ranks other than 0 would enter the first bucket's gathers (TP / EP collectives, bounded by
`trainer.collective_timeout_s`) while rank 0 still waits for the engines to accept `start_weight_update`, which
waits for a rollout still generating (async mode). They wait at the gate instead: one broadcast from rank 0 over
a gloo group of its own whose timeout is the push bound, sent when rank 0's source starts iterating (after the
start) or, when rank 0 fails before that, as a refusal that lets them return idle (the trainer pool keeps them).
"""
from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Callable

import torch

log = logging.getLogger(__name__)

ABORT_GRACE_S = 10.0  # after an abort, how long the pushing thread may take to unwind before rank 0 raises anyway
FAULT_SLACK_S = 5.0  # past the bound, the client's own "no answer" verdict (same bound) is waited for this long
DEFAULT_GATE_TIMEOUT_S = 1800.0


class PushTimeout(TimeoutError):
    """A push still running past rollout.push_timeout_s with no engine at fault: aborted on trainer rank 0."""


class PushNotStarted(RuntimeError):
    """Trainer rank 0 failed before the engines accepted the push's start: the other ranks return untouched."""


def send_bounded(send: Callable[[], None], fault: Callable[[], BaseException | None], abort: Callable[[], None],
                 timeout_s: float | None, reset: Callable[[], None] | None = None, poll_s: float = 0.05,
                 slack_s: float = FAULT_SLACK_S) -> None:
    """Run `send()` on a thread of its own; return when it returns, raise what it raises. If `fault()` reports an
    error first (an engine's, seen by the client) or `timeout_s` (+ `slack_s`) passes: `abort()`, wait up to
    ABORT_GRACE_S for the thread, raise that error (PushTimeout for the bound). reset: clears the client's fault
    of an earlier push first."""
    if reset is not None:
        reset()
    done, outcome = threading.Event(), {}

    def run() -> None:
        try:
            send()
        except BaseException as e:  # noqa: BLE001 - handed to the watching thread
            outcome["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="weight-push", daemon=True).start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s + slack_s
    while not done.wait(poll_s):
        why = fault()
        if why is None and deadline is not None and time.monotonic() > deadline:
            why = PushTimeout(f"weight push still running after rollout.push_timeout_s ({timeout_s} s)")
        if why is None:
            continue
        log.warning("weight push aborted on trainer rank 0: %s", why)
        try:
            abort()
        except Exception as e:  # noqa: BLE001 - the push's own error is the one to report
            log.warning("weight push: aborting the sender raised %s", e)
        done.wait(ABORT_GRACE_S)
        raise why
    if "error" in outcome:
        raise outcome["error"]


class PushGate:
    """Rank 0's "the engines started the push" to the other trainer ranks, once per push (see the module
    docstring). begin() before each push; pass_through() where a rank's source starts iterating (rank 0: after
    vLLM's `start_weight_update`); end() after the push on every rank (rank 0 refuses if it never passed; the
    others take the message they did not wait for). A world of one rank has nothing to gate."""

    def __init__(self, rank: int, group) -> None:
        self.rank, self.group = rank, group
        self._lock = threading.Lock()  # rank 0: the pushing thread's open against the watcher's refusal
        self._state = "idle"  # idle | waiting | open | refused, per push

    @classmethod
    def create(cls, rank: int, timeout_s: float | None) -> "PushGate":
        """Every rank, together (a new process group is collective): a gloo group bounded by the push's bound."""
        dist = torch.distributed
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return cls(rank, None)
        timeout = datetime.timedelta(seconds=timeout_s or DEFAULT_GATE_TIMEOUT_S)
        return cls(rank, dist.new_group(backend="gloo", timeout=timeout))

    def begin(self) -> None:
        self._state = "waiting"

    def _send(self, started: bool) -> None:
        torch.distributed.broadcast(torch.tensor([int(started)]), src=0, group=self.group)

    def _receive(self) -> bool:
        flag = torch.zeros(1, dtype=torch.int64)
        torch.distributed.broadcast(flag, src=0, group=self.group)
        return bool(flag.item())

    def pass_through(self) -> None:
        """Rank 0: open the gate (raises PushNotStarted if it was refused meanwhile). Other ranks: wait for rank 0
        (up to the gate's bound); PushNotStarted if it refused."""
        if self.group is None:
            return
        with self._lock:
            if self._state != "waiting":  # opened already this push (a source iterated twice), or refused
                if self._state == "refused":
                    raise PushNotStarted("trainer rank 0 refused the push before its start")
                return
            if self.rank == 0:
                self._state = "open"
                self._send(True)
                return
            self._state = "open" if self._receive() else "refused"
            if self._state == "refused":
                raise PushNotStarted("trainer rank 0 failed before the engines started the push")

    def end(self) -> None:
        """After this rank's push, success or not: keep the one message per push in step."""
        if self.group is None:
            return
        with self._lock:
            if self._state != "waiting":
                return
            if self.rank == 0:
                self._state = "refused"
                self._send(False)
            else:
                self._state = "open" if self._receive() else "refused"
