"""How `gspo-ray` reports errors: a user error is one line per problem and exit code 2, without a traceback
(`gspo-ray --debug ...` or GSPO_RAY_DEBUG=1 shows it); any other exception is one `error: Type: message` line and
exit 1 (`run_app`; the traceback with --debug), whatever its class: never click's bare `Aborted.`

    with user_errors():
        report = run_preflight(cfg)
"""
from __future__ import annotations

import os
import traceback
from contextlib import contextmanager
from typing import Iterator

import typer

USER_ERROR_EXIT = 2
_state = {"debug": os.environ.get("GSPO_RAY_DEBUG", "") not in ("", "0")}  # the CLI sets it from --debug


def set_debug(on: bool) -> None:
    _state["debug"] = on


def user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions that mean 'the input is wrong': the config, a plug-in, or what the preflight found."""
    from gspo_ray.config import ConfigError
    from gspo_ray.envs.plugins import PluginError
    from gspo_ray.preflight.model import PreflightError

    return ConfigError, PluginError, PreflightError


def error_lines(e: BaseException) -> list[str]:
    """`error: ...` lines for a user error, each one self-contained."""
    lines = e.lines() if hasattr(e, "lines") else [" ".join(str(e).split())]
    return [f"error: {line}" for line in lines]


@contextmanager
def user_errors(exit_code: int = USER_ERROR_EXIT) -> Iterator[None]:
    """Turn a user error raised inside the block into its lines on stderr and `exit_code`."""
    try:
        yield
    except user_error_types() as e:
        if _state["debug"]:
            traceback.print_exc()
        for line in error_lines(e):
            typer.echo(line, err=True)
        raise typer.Exit(exit_code) from None


def preflight_or_exit(cfg, verbose: bool = False, remember: bool = False, require_weights: bool = True):
    """Run the preflight (gspo_ray/preflight/) before Ray or any engine starts: on a bad input, its line and
    exit 2; else the report's lines (verbose) and its summary on stdout (stderr is for errors). `remember`: the
    data files that pass are recorded in the run directory, and unchanged ones recorded before are not re-read."""
    from gspo_ray.preflight import run_preflight

    with user_errors():
        report = run_preflight(cfg, remember_in=cfg.run_dir if remember else None, require_weights=require_weights)
    for line in report.lines() if verbose else []:
        typer.echo(line)
    typer.echo(report.summary())
    return report


# ---- the command layer: nothing ends unexplained ------------------------------------------------------------------
class _Escaped(Exception):
    """Carries an exception that click/typer would otherwise turn into a bare `Aborted.` (EOFError) or a silent
    exit 130 (KeyboardInterrupt) past their handlers, to `run_app`."""

    def __init__(self, original: BaseException):
        super().__init__(repr(original))
        self.original = original


def describe_exception(e: BaseException) -> str:
    """`Type: message` on one line. A Ray task error names the remote exception's type and the remote call
    (its message holds the whole remote traceback otherwise)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and type(e).__name__.startswith("RayTaskError"):
        where = getattr(e, "function_name", None)
        return f"{type(cause).__name__}: {' '.join(str(cause).split())}" + (f" (in {where})" if where else "")
    message = " ".join(str(e).split())
    if len(message) > 1000:  # one line, not a screen
        message = message[:1000] + " ..."
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


def report_unexpected(e: BaseException) -> None:
    """One `error: Type: message` line on stderr; the traceback first with --debug."""
    if _state["debug"]:
        traceback.print_exception(type(e), e, e.__traceback__)
    hint = "" if _state["debug"] else " (gspo-ray --debug ... shows the traceback)"
    typer.echo(f"error: {describe_exception(e)}{hint}", err=True)
    from gspo_ray.coordinator.remote_errors import remote_error_block

    block = None if _state["debug"] else remote_error_block(e)  # a Ray actor's traceback or death cause
    if block:
        typer.echo(f"the actor's side:\n{block}", err=True)


def run_app(app, args: list[str] | None = None, prog_name: str = "gspo-ray") -> int:
    """Run a Typer app and return its exit code. Usage errors and `typer.Exit` keep their codes and output;
    `SystemExit` passes its code through; KeyboardInterrupt (Ctrl-C before the job's own handler is in place, or
    raised by a child) is one line and 130; any other exception, EOFError included, is one
    `error: Type: message` line and exit 1 (the traceback with --debug)."""
    # typer ships its own copy of click; its public names lead to the classes it raises
    click_exception = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
    command = typer.main.get_command(app)
    invoke = command.invoke

    def guarded_invoke(ctx):
        try:
            return invoke(ctx)
        except (EOFError, KeyboardInterrupt) as e:  # click turns these into `Aborted.` / a silent 130
            raise _Escaped(e) from e

    command.invoke = guarded_invoke
    try:
        rv = command.main(args=args, prog_name=prog_name, standalone_mode=False)
        return rv if isinstance(rv, int) and not isinstance(rv, bool) else 0
    except typer.Exit as e:
        return e.exit_code
    except click_exception as e:  # usage errors: click's own message, its exit code (2)
        e.show()
        return e.exit_code
    except typer.Abort:  # a prompt cut short
        typer.echo("error: aborted", err=True)
        return 1
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        typer.echo(f"error: {e.code}", err=True)
        return 1
    except _Escaped as wrapped:
        e = wrapped.original
        if isinstance(e, KeyboardInterrupt):
            if _state["debug"]:
                traceback.print_exception(type(e), e, e.__traceback__)
            typer.echo(f"error: interrupted ({describe_exception(e)})", err=True)
            return 130
        report_unexpected(e)
        return 1
    except KeyboardInterrupt as e:  # during argument parsing
        typer.echo(f"error: interrupted ({describe_exception(e)})", err=True)
        return 130
    except Exception as e:
        report_unexpected(e)
        return 1
