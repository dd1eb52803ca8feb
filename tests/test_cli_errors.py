"""No error reaches the command layer unexplained: whatever its class, an exception out of a command ends in one
`error: Type: message` line (the traceback only with --debug), never click's bare `Aborted.`; exit codes of
`typer.Exit` / SystemExit pass through; a KeyboardInterrupt is one line and 130.

`run_app` is what the `gspo-ray` console script runs (cli/main.py `main`); here it runs a real Typer app whose
commands raise on purpose, plus the real `gspo-ray` in a subprocess."""
from __future__ import annotations

import subprocess
import sys

import pytest
import typer

from gspo_ray.cli.errors import run_app, set_debug


def _app():
    app = typer.Typer(add_completion=False)

    @app.callback()
    def options(debug: bool = typer.Option(False, "--debug")):
        set_debug(debug)

    @app.command()
    def eof():
        raise EOFError("Ran out of input")  # what torch.load raises on a truncated file

    @app.command()
    def interrupt():
        raise KeyboardInterrupt("from a child")

    @app.command()
    def sysexit(code: int):
        raise SystemExit(code)

    @app.command()
    def texit(code: int):
        raise typer.Exit(code)

    @app.command()
    def boom():
        raise ValueError("multi\nline   message")

    @app.command()
    def ok():
        typer.echo("fine")

    return app


@pytest.fixture(autouse=True)
def _no_debug():
    yield
    set_debug(False)


def test_eof_error_is_named_not_aborted(capsys):
    assert run_app(_app(), ["eof"]) == 1
    err = capsys.readouterr().err
    assert "Aborted" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: EOFError: Ran out of input"), lines


def test_debug_adds_the_traceback(capsys):
    assert run_app(_app(), ["--debug", "eof"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and 'raise EOFError("Ran out of input")' in err
    assert err.strip().splitlines()[-1] == "error: EOFError: Ran out of input"


def test_any_exception_is_one_line(capsys):
    assert run_app(_app(), ["boom"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ValueError: multi line message"), lines


def test_keyboard_interrupt_is_named_and_130(capsys):
    assert run_app(_app(), ["interrupt"]) == 130
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["error: interrupted (KeyboardInterrupt: from a child)"]


@pytest.mark.parametrize("code", [0, 3, 143])
def test_exit_codes_pass_through(code, capsys):
    assert run_app(_app(), ["sysexit", str(code)]) == code
    assert run_app(_app(), ["texit", str(code)]) == code
    assert capsys.readouterr().err == ""


def test_success_and_usage_errors_keep_their_codes(capsys):
    assert run_app(_app(), ["ok"]) == 0
    assert capsys.readouterr().out == "fine\n"
    assert run_app(_app(), ["nosuch"]) == 2
    assert "No such command" in capsys.readouterr().err


def test_the_console_script_names_an_eof_error(tmp_path):
    """The real `gspo-ray` entry point (`main`), a command added that fails as a truncated torch.load does:
    before, click printed only `Aborted.` (exit 1), even with --debug."""
    code = ("import sys\nimport gspo_ray.cli\nm = sys.modules['gspo_ray.cli.main']\n"
            "@m.app.command('load-broken')\ndef load_broken():\n    raise EOFError('Ran out of input')\n"
            "sys.argv = ['gspo-ray', *sys.argv[1:]]\nm.main()\n")
    for args, traceback_shown in ((["load-broken"], False), (["--debug", "load-broken"], True)):
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1 and "Aborted" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("error: EOFError: Ran out of input"), proc.stderr
        assert ("Traceback" in proc.stderr) == traceback_shown, proc.stderr
