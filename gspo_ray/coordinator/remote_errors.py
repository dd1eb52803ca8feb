"""What a Ray actor's failure says, as a block the driver's console can show.

Jobs start Ray with `log_to_driver=False` (every engine's and rank's log on the console would bury the job's own
lines), so an actor's traceback printed on its side is not on the driver's console. The exception the driver gets
carries it anyway: a RayTaskError holds the remote traceback, a RayActorError the death's cause (a constructor's
traceback, or Ray's exit type and detail: OOM kill, segfault, lost node). `remote_error_block` keeps that text
readable, its head and its last lines (the raising frames and the exception), for a log line or the CLI's error.
"""
from __future__ import annotations

MAX_LINES = 16  # the header, then the last lines: the raising frames and the exception


def remote_error_block(e: BaseException, max_lines: int = MAX_LINES) -> str | None:
    """The remote side of the first Ray actor error in `e`'s chain (`e`, its `__cause__`, `__context__`), as
    indented lines; None when the chain holds none."""
    import sys

    if "ray.exceptions" not in sys.modules:  # no Ray error can exist yet (and no Ray import on an error path)
        return None
    from ray.exceptions import RayActorError, RayTaskError

    seen: set[int] = set()
    while e is not None and id(e) not in seen and not isinstance(e, (RayActorError, RayTaskError)):
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    if e is None or id(e) in seen:
        return None
    lines = [line.rstrip() for line in str(e).splitlines() if line.strip()]
    if len(lines) > max_lines:
        lines = lines[:1] + [f"... ({len(lines) - max_lines + 1} lines)"] + lines[-(max_lines - 2):]
    return "\n".join("    " + line for line in lines)
