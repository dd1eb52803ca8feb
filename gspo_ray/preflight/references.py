"""The reward's check of every reference (`check_reference(reference) -> str | None`), run in worker processes
with a per-reference timeout.

    problems = check_references([math_reference_problem], [(0, "18"), (0, "eighteen")], timeout_s=10.0)
    # [None, "math-verify cannot parse the reference 'eighteen'"]

Why processes: a check may call sympy (math-verify's `parse`), which can take unbounded time on odd input, and
math-verify's own timeout is a signal that works only on a main thread. A thread cannot be stopped; a process can.
Each worker writes the index of the reference it is on into shared memory; the parent kills a worker whose index
has not moved for `timeout_s`, reports that reference as timed out, and gives the rest of its chunk to a fresh
worker. A check that raises, or kills its process, is that reference's problem too. Identical references are
checked once. Workers are forked where the platform can (Linux): they start in milliseconds with the parent's
imports, the check functions included, so nothing is pickled but the references.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from gspo_ray.preflight.report import one_line

CHUNK = 256  # references per message to a worker: the pipe's cost per reference stays small
TICK_S = 0.05  # how often a stalled worker is looked for
MAX_WORKERS = 16
MAX_RESTARTS = 3  # workers that die between references before the check gives up


def default_workers() -> int:
    """The CPUs this process may run on, at most MAX_WORKERS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_WORKERS))


def _context():
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def _serve(conn, checks: Sequence[Callable], current) -> None:
    """A worker: chunks of (check index, reference) in, {index: problem} out per chunk; `current` holds the index
    of the reference being checked (-1 between chunks)."""
    # A forked worker inherits the CLI's stop handlers and wakeup fd. Ctrl-C reaches the whole foreground group:
    # the parent decides (it stops the workers on its way out), so a worker ignores it; SIGTERM ends a worker.
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        job = conn.recv()
        if job is None:
            return
        start, batch = job
        found = {}
        for i, (c, reference) in enumerate(batch):
            current.value = start + i
            try:
                problem = checks[c](reference)
            except Exception as e:  # a check that raises makes its reference unusable, like a refusal
                problem = f"check_reference raised {type(e).__name__}: {one_line(e, 200)}"
            if problem:
                found[start + i] = str(problem)
        current.value = -1
        conn.send((start, len(batch), found))


@dataclass
class _Worker:
    proc: Any
    conn: Any
    current: Any  # a shared int: the reference being checked
    job: tuple[int, list] | None = None
    seen: tuple[int, float] = field(default_factory=lambda: (-1, time.monotonic()))

    def assign(self, job: tuple[int, list]) -> None:
        self.job, self.seen = job, (-1, time.monotonic())
        self.conn.send(job)

    def stop(self, kill: bool) -> None:
        if not kill:
            try:
                self.conn.send(None)
            except OSError:
                kill = True
        self.proc.join(None if not kill else 0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def _start(ctx, checks: Sequence[Callable]) -> _Worker:
    parent, child = ctx.Pipe()
    current = ctx.RawValue("q", -1)
    proc = ctx.Process(target=_serve, args=(child, checks, current), name="preflight-references", daemon=True)
    proc.start()
    child.close()
    return _Worker(proc, parent, current)


def check_references(checks: Sequence[Callable], items: Sequence[tuple[int, Any]], timeout_s: float,
                     workers: int | None = None, timeout_field: str = "") -> list[str | None]:
    """`checks[c](reference)` for every (c, reference) of `items`, in `workers` processes (default: the CPUs this
    process may use); the problem each returns, or None. A reference whose check runs past `timeout_s` gets the
    problem "the reference check did not finish within T s (`timeout_field`)"."""
    unique: dict[tuple[int, str, str], int] = {}
    jobs, slots = [], []
    for c, reference in items:
        key = (c, type(reference).__name__, repr(reference))
        if key not in unique:
            unique[key] = len(jobs)
            jobs.append((c, reference))
        slots.append(unique[key])
    results: list[str | None] = [None] * len(jobs)
    pending = deque((s, jobs[s:s + CHUNK]) for s in range(0, len(jobs), CHUNK))
    if not pending:
        return []
    ctx = _context()
    pool = [_start(ctx, checks) for _ in range(min(workers or default_workers(), len(pending)))]
    left, restarts = len(jobs), 0
    late = f"the reference check did not finish within {timeout_s:g} s"
    late += f" ({timeout_field})" if timeout_field else ""
    try:
        while left:
            for w in pool:
                if w.job is None and pending:
                    w.assign(pending.popleft())
            busy = {w.conn: w for w in pool if w.job is not None}
            for conn in multiprocessing.connection.wait(list(busy), timeout=TICK_S):
                w = busy[conn]
                try:
                    start, count, found = conn.recv()
                except (EOFError, OSError):  # the check ended its process: that reference is the problem
                    w.proc.join(1.0)  # the pipe closes before the process is reaped
                    code = w.proc.exitcode
                    settled = _drop(w, pending, results, f"the reference check ended its process (exit code {code})")
                    restarts += 1 - settled
                    if restarts > MAX_RESTARTS:  # workers die before any check: nothing to blame on a row
                        raise RuntimeError(f"reference check workers exit before checking anything (exit code {code})")
                    left -= settled
                    pool[pool.index(w)] = _start(ctx, checks)
                    continue
                for i, problem in found.items():
                    results[i] = problem
                left, w.job = left - count, None
            now = time.monotonic()
            for w in [w for w in pool if w.job is not None]:
                index = w.current.value
                if index != w.seen[0]:
                    w.seen = (index, now)
                elif index >= 0 and now - w.seen[1] > timeout_s:
                    left -= _drop(w, pending, results, late)
                    pool[pool.index(w)] = _start(ctx, checks)
    finally:
        for w in pool:
            w.stop(kill=w.job is not None)
    return [results[s] for s in slots]


def _drop(w: _Worker, pending: deque, results: list, problem: str) -> int:
    """A worker stuck on (or killed by) its current reference: that reference gets `problem`, the rest of its
    chunk (before and after it: results not yet sent) goes back to the front of the queue. Returns 1 (one
    reference settled)."""
    start, batch = w.job
    index = w.current.value
    if index < 0:  # it died between references: nothing to blame, everything to redo
        pending.appendleft((start, batch))
        w.job = None
        w.stop(kill=True)
        return 0
    results[index] = problem
    after, before = batch[index + 1 - start:], batch[:index - start]
    for s, part in ((index + 1, after), (start, before)):
        if part:
            pending.appendleft((s, part))
    w.job = None
    w.stop(kill=True)
    return 1
