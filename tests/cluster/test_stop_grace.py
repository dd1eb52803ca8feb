"""`gspo-ray stop` gives the job a grace period: Ray's stop_job sends SIGTERM and then SIGKILL after
RAY_JOB_STOP_WAIT_TIME_S, which the job's supervisor reads from the job's runtime_env (Ray's default 3 s is too
short to finish a step and save a checkpoint). Submission sets it; that Ray honours it on a real cluster:
tests/cluster/test_submit.py::test_stop_waits_the_grace_period_given_at_submission. (`submit --grace-s`, default 300: a smollm2_sum step + its save, twice)."""
from __future__ import annotations

from pathlib import Path

from gspo_ray.cli import submission

ROOT = Path(__file__).resolve().parents[2]


def test_submission_sets_the_stop_grace_period():
    env = submission.build_runtime_env(ROOT)
    assert env["env_vars"][submission.STOP_GRACE_ENV] == str(submission.DEFAULT_STOP_GRACE_S) == "300"
    assert submission.build_runtime_env(ROOT, stop_grace_s=90)["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == "90"
    # an explicit value in the caller's runtime_env wins
    mine = submission.build_runtime_env(ROOT, {"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "5"}}, stop_grace_s=300)
    assert mine["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == "5"


def test_the_cli_commands_import():
    """submit/status/logs/stop import the submission client (they imported a module that no longer existed)."""
    from typer.testing import CliRunner

    from gspo_ray.cli import app

    result = CliRunner().invoke(app, ["status", "raysubmit_x", "--address", "http://127.0.0.1:9"])
    assert "ImportError" not in repr(result.exception), result.exception
