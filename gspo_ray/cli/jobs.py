"""`gspo-ray submit | status | logs | stop`: training jobs on a running Ray cluster through Ray Job Submission.

    gspo-ray submit gspo_ray/recipes/tiny_moe.yaml logging.out_dir=/shared/runs --address http://HEAD:8265 --wait
    gspo-ray status raysubmit_XXXX        gspo-ray logs raysubmit_XXXX --follow        gspo-ray stop raysubmit_XXXX

`--address` defaults to $RAY_ADDRESS (the dashboard URL, as for `ray job submit`). Registered on the main app with
`app.registered_commands += jobs_app.registered_commands`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
import yaml

jobs_app = typer.Typer(no_args_is_help=True, help="run jobs on a Ray cluster")

ADDRESS = typer.Option(None, "--address", envvar="RAY_ADDRESS",
                       help="dashboard URL of the cluster, e.g. http://127.0.0.1:8265 (default: $RAY_ADDRESS)")


def _runtime_env(value: Optional[str]) -> Optional[dict]:
    """--runtime-env: inline JSON, or a YAML/JSON file."""
    if value is None:
        return None
    path = Path(value)
    try:
        data = yaml.safe_load(path.read_text()) if path.exists() else json.loads(value)
    except (ValueError, yaml.YAMLError) as e:
        typer.echo(f"error: --runtime-env: neither a readable file nor JSON: {e}", err=True)
        raise typer.Exit(2)
    if not isinstance(data, dict):
        typer.echo("error: --runtime-env must be a mapping", err=True)
        raise typer.Exit(2)
    return data


def _follow(job_id: str, address: Optional[str]) -> None:
    from gspo_ray.cli import submission as jobs

    for chunk in jobs.logs(job_id, address, follow=True):
        typer.echo(chunk, nl=False)


@jobs_app.command()
def submit(file: Path, overrides: list[str] = typer.Argument(None, help="key.path=value overrides"),
           address: Optional[str] = ADDRESS,
           working_dir: Path = typer.Option(Path("."), help="uploaded with the job and put on its PYTHONPATH"),
           runtime_env: Optional[str] = typer.Option(None, help="extra Ray runtime_env: JSON or a YAML file"),
           job_id: Optional[str] = typer.Option(None, help="submission id (default: generated)"),
           resume: bool = typer.Option(False, "--resume", help="continue from the run's last checkpoint"),
           validate: bool = typer.Option(True, "--validate/--no-validate",
                                         help="check the job file here first (off: paths exist only on the cluster)"),
           wait: bool = typer.Option(False, "--wait", help="stream the logs and exit with the job's result"),
           grace_s: int = typer.Option(300, "--grace-s", min=1, help="`gspo-ray stop`: seconds from SIGTERM (the "
                                       "job saves a checkpoint at its next step boundary) to SIGKILL; fixed here "
                                       "because Ray reads it when the job starts. Default: a smollm2_sum step "
                                       "(33-80 s) + its save (~60 s) + shutdown, twice; give a bigger model its "
                                       "step + save time")):
    """Validate a job file here (the whole preflight of `config validate`), then run `gspo-ray train FILE
    overrides` on the cluster."""
    from gspo_ray.cli import submission as jobs
    from gspo_ray.cli.errors import preflight_or_exit, user_errors
    from gspo_ray.config import load_config

    with user_errors():
        if validate:  # model dir, data, plug-ins: fail here in seconds, not on the cluster after the upload
            preflight_or_exit(load_config(file, overrides or []))
        jid = jobs.submit(file, address, overrides or [], working_dir=working_dir,
                          runtime_env=_runtime_env(runtime_env), job_id=job_id, resume=resume,
                          validate=validate, stop_grace_s=grace_s)
    typer.echo(f"submitted {jid}")
    if not wait:
        typer.echo(f"  gspo-ray logs {jid} --follow    gspo-ray status {jid}    gspo-ray stop {jid}")
        return
    _follow(jid, address)
    final = jobs.wait(jid, address, timeout_s=60)
    typer.echo(f"{jid}: {final.value}")
    raise typer.Exit(0 if final.value == "SUCCEEDED" else 1)


@jobs_app.command()
def status(job_id: str, address: Optional[str] = ADDRESS):
    """Print the job's status (PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED) and Ray's message."""
    from gspo_ray.cli import submission as jobs

    details = jobs.info(job_id, address)
    typer.echo(f"{job_id}: {details.status.value}" + (f" ({details.message})" if details.message else ""))


@jobs_app.command()
def logs(job_id: str, address: Optional[str] = ADDRESS,
         follow: bool = typer.Option(False, "--follow", "-f", help="keep streaming until the job ends")):
    """Print the driver's output."""
    from gspo_ray.cli import submission as jobs

    if follow:
        _follow(job_id, address)
    else:
        for chunk in jobs.logs(job_id, address):
            typer.echo(chunk, nl=False)


@jobs_app.command()
def stop(job_id: str, address: Optional[str] = ADDRESS,
         wait: bool = typer.Option(True, "--wait/--no-wait", help="wait until the job has ended")):
    """Stop a running job: SIGTERM to its driver, which finishes the step in progress, saves a checkpoint and
    exits 143 (continue it with `submit ... --resume`); SIGKILL only if it has not ended after the grace period
    given at submission (`submit --grace-s`, default 300 s). The cluster stays up."""
    from gspo_ray.cli import submission as jobs

    if not jobs.stop(job_id, address):
        typer.echo(f"{job_id}: already finished")
        return
    grace = jobs.stop_grace_s(job_id, address)
    typer.echo(f"{job_id}: stopping (SIGTERM; SIGKILL after {grace} s if it has not ended)")
    if not wait:
        return
    try:
        final = jobs.wait(job_id, address, timeout_s=grace + 30)
    except TimeoutError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1)
    typer.echo(f"{job_id}: {final.value}")
