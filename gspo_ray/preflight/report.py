"""What the preflight reports, and how it runs user code: one-line errors, a report of checks, a call with a
timeout on a daemon thread."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from gspo_ray.envs.plugins import PluginError, raise_site
from gspo_ray.preflight.model import PreflightError

IMPORT_TIMEOUT_S = 60.0  # a plug-in module may import heavy libraries; one that hangs still ends the preflight
MAX_LINE = 300
SUMMARY_FACTS = ("anchor",)  # checks whose detail `train` prints under its summary line too


def one_line(e: BaseException | str, limit: int = MAX_LINE) -> str:
    """An error message folded onto one line and cut to `limit` characters."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class Check:
    name: str
    status: str  # "ok" | "skipped" | "warning"
    detail: str


@dataclass
class PreflightReport:
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, name: str, status: str, detail: str) -> None:
        self.checks.append(Check(name, status, detail))

    def lines(self) -> list[str]:
        return [f"  {c.name:<10} {c.status:<8} {c.detail}" for c in self.checks]

    def summary(self) -> str:
        """The line `train` prints, then the job's facts the checks settled (SUMMARY_FACTS: which anchor)."""
        notes = [f"{c.name} {c.status}" for c in self.checks if c.status != "ok"]
        facts = [f"{c.name}: {c.detail}" for c in self.checks if c.name in SUMMARY_FACTS]
        return "\n".join([f"preflight ok in {self.seconds:.1f} s" + (f" ({', '.join(notes)})" if notes else ""),
                          *facts])


def call_with_timeout(fn: Callable[[], Any], timeout_s: float, what: str, timeout_field: str = "") -> Any:
    """fn() on a daemon thread. PreflightError when it raises (plug-in errors keep their own message) or runs
    past `timeout_s` (the thread cannot be killed; it is left behind and never blocks the process's exit).
    `timeout_field`: the config field that sets the limit, named only when the call ran out of time."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # user code may raise anything, SystemExit included
            box["error"] = e

    thread = threading.Thread(target=run, name="preflight-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise PreflightError(f"{what} did not return within {timeout_s:g} s"
                             + (f" ({timeout_field})" if timeout_field else ""))
    error = box.get("error")
    if isinstance(error, (PreflightError, PluginError)):
        raise PreflightError(one_line(error, 2 * MAX_LINE)) from error  # the plug-in's message is the point
    if error is not None:
        site = raise_site(error)
        raise PreflightError(f"{what} raised {type(error).__name__}{f' at {site}' if site else ''}: "
                             f"{one_line(error, 200)}") from error
    return box["value"]
