"""How `gspo-ray` reports errors: a user error is one line per problem and exit code 2, without a traceback
(`gspo-ray --debug ...` or GSPO_RAY_DEBUG=1 shows it); any other exception is a bug and keeps its traceback.

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


def preflight_or_exit(cfg, verbose: bool = False):
    """Run the preflight (gspo_ray/preflight/) before Ray or any engine starts: on a bad input, its line and
    exit 2; else the report's lines (verbose) and its summary on stdout (stderr is for errors)."""
    from gspo_ray.preflight import run_preflight

    with user_errors():
        report = run_preflight(cfg)
    for line in report.lines() if verbose else []:
        typer.echo(line)
    typer.echo(report.summary())
    return report
