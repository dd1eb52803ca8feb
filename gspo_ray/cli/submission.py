"""Ray Job Submission helpers: run `gspo-ray train CONFIG` on a running cluster (local head, KubeRay, Slurm, cloud).

    gspo-ray submit gspo_ray/recipes/tiny_moe.yaml logging.out_dir=/shared/runs --address http://HEAD:8265 --wait

    from gspo_ray.cli import submission as jobs
    job_id = jobs.submit("gspo_ray/recipes/tiny_moe.yaml", "http://127.0.0.1:8265", ["coordinator.steps=50"])
    jobs.wait(job_id, "http://127.0.0.1:8265", timeout_s=3600)

`address` is the cluster's dashboard URL (http://HEAD:8265); None falls back to $RAY_ADDRESS /
$RAY_API_SERVER_ADDRESS as in `ray job submit`. The config is validated here, before anything is uploaded,
so a bad field fails in seconds on the submitting machine instead of minutes into the job.

The job's driver runs `gspo-ray` from the cluster's Python environment, with `working_dir` (the project tree,
minus `DEFAULT_EXCLUDES`: environments, caches and credential files) uploaded and put first on its PYTHONPATH. Relative paths in the job file (data files,
`logging.out_dir`) are resolved inside that uploaded copy, which lives in the head's Ray session directory:
point `logging.out_dir` at storage that outlives the cluster.
"""
from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import secrets
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from gspo_ray.config import ConfigError, JobConfig, load_config
from gspo_ray.config.secrets import redact_args

log = logging.getLogger(__name__)

# Uploaded with every job otherwise (Ray caps a working_dir at 500 MiB): environments, run outputs, caches.
BULK_EXCLUDES = [".venv", "venv", ".git", "runs", "build", "dist", "*.egg-info", "**/__pycache__", "*.pyc",
                 ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache"]
# Never uploaded: credential files a working directory tends to hold (gitwildmatch patterns, at any depth). The
# uploaded package sits in the cluster's object store and in every node's session directory that runs the job.
SECRET_EXCLUDES = [".env", ".env.*", "*.env", ".envrc", "*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.token",
                   "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", ".netrc", ".pgpass", ".git-credentials",
                   ".pypirc", ".npmrc", "*credentials*", "*service-account*.json", "auth_token", ".aws/", ".ssh/",
                   ".gnupg/", ".kube/", ".docker/", ".ray/"]
DEFAULT_EXCLUDES = BULK_EXCLUDES + SECRET_EXCLUDES

TRAIN_ENTRYPOINT = "gspo-ray train"
# `stop_job` sends SIGTERM to the driver, then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S, read by the job's supervisor
# actor from the job's runtime_env when the job starts (Ray's default: 3 s, too short for the driver to finish its
# step and save a checkpoint). The grace period is therefore fixed at submission. The default covers the slowest
# packaged recipe with a 2x margin: a smollm2_sum step (33-80 s measured on 2 cores) + a save of its 2.1 GB
# checkpoint (~60 s on that machine: write + fsync 36 s, sha256 of the manifest 24 s) + pool shutdown (~10 s)
# = ~150 s. A bigger model needs `submit --grace-s` >= its step time + save time (docs/async-and-failures.md).
STOP_GRACE_ENV = "RAY_JOB_STOP_WAIT_TIME_S"
DEFAULT_STOP_GRACE_S = 300


def auth_headers() -> dict[str, str] | None:
    """Ray's token header when `RAY_AUTH_MODE=token` is set now: $RAY_AUTH_TOKEN, else the file at
    $RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token. Sent explicitly because Ray reads its auth mode once per process:
    a process that used a Ray client before the variable was set would otherwise send no token."""
    if os.environ.get("RAY_AUTH_MODE") != "token":
        return None
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if not token:
        path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
        token = path.read_text().strip() if path.is_file() else ""
    return {"Authorization": f"Bearer {token}"} if token else None


def _client(address: str | None):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address, headers=auth_headers())


def build_runtime_env(working_dir: str | Path, runtime_env: dict[str, Any] | None = None,
                      cfg: JobConfig | None = None, stop_grace_s: int = DEFAULT_STOP_GRACE_S) -> dict[str, Any]:
    """The job-level runtime_env: the uploaded project plus the caller's extras.

    The driver later calls `ray.init(runtime_env=cluster.runtime_env + its own env_vars)`; Ray merges that with
    this one and, by default, refuses a key set in both. `RAY_OVERRIDE_JOB_RUNTIME_ENV=1` makes the driver's
    values win instead, and a clash between `runtime_env` here and the job file's `cluster.runtime_env` is
    reported now, naming the field. `stop_grace_s`: seconds between the SIGTERM of `gspo-ray stop` and the
    SIGKILL (the driver saves a checkpoint at its next step boundary in between); an explicit
    RAY_JOB_STOP_WAIT_TIME_S in `runtime_env` wins.
    """
    extra = dict(runtime_env or {})
    env_vars = dict(extra.pop("env_vars", {}))
    if cfg is not None:
        _check_runtime_env_clash(extra, env_vars, cfg.cluster.runtime_env)
    wd = Path(working_dir).resolve()
    if not wd.is_dir():
        raise ConfigError(f"working_dir: not a directory: {wd}")
    env: dict[str, Any] = {"working_dir": str(wd), "excludes": DEFAULT_EXCLUDES + list(extra.pop("excludes", []))}
    env.update(extra)
    env["env_vars"] = {"RAY_OVERRIDE_JOB_RUNTIME_ENV": "1", STOP_GRACE_ENV: str(int(stop_grace_s)), **env_vars}
    return env


def _check_runtime_env_clash(extra: dict, env_vars: dict, cluster_env: dict) -> None:
    clash = sorted(set(extra) & (set(cluster_env) - {"env_vars"}))
    clash += sorted(f"env_vars.{k}" for k in set(env_vars) & set(cluster_env.get("env_vars", {})))
    if clash:
        raise ConfigError(f"cluster.runtime_env.{clash[0]}: also given in the submission's runtime_env "
                          f"({', '.join(clash)}); set each key in one place")


def _config_arg(config_path: Path, working_dir: Path) -> str:
    """The config path as the job sees it: relative to the uploaded working_dir when it lies inside it."""
    try:
        return config_path.resolve().relative_to(working_dir.resolve()).as_posix()
    except ValueError:
        log.warning("%s is outside working_dir %s: the job reads it by absolute path, so the cluster must see "
                    "the same filesystem", config_path, working_dir)
        return str(config_path.resolve())


# The module (a name, not a secret) that carries a submitted job's secret-valued overrides; `gspo-ray train`
# appends them. The module travels as a `py_modules` package: Ray's job record keeps its URI, never its content.
SECRET_MODULE_ENV = "GSPO_RAY_SECRET_MODULE"
# Where Ray's job supervisor hands a submitted driver its job config (runtime_env and metadata) as JSON; the
# driver's ray.init merges it into the runtime_env of every actor (ray/_private/runtime_env/constants.py).
RAY_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def split_secret_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(overrides without a secret value, those with one: `...HF_TOKEN=...`, URL credentials; config/secrets.py)."""
    public, secret = [], []
    for o in overrides:
        (secret if redact_args([o]) != [o] else public).append(o)
    return public, secret


def write_secret_module(secret: Sequence[str], directory: Path) -> tuple[Path, str]:
    """A package (a 0700 directory with a 0600 one-line `__init__.py`) holding the secret overrides, in
    `directory` (a private temp directory). Returns (its directory, its module name): a fresh random name, so two
    jobs never share one. A package, not a one-file module: Ray's job client uploads py_modules entries as
    directories (a .py file fails there, Ray 2.60)."""
    name = f"gspo_ray_job_{secrets.token_hex(8)}"
    package = directory / name
    package.mkdir(mode=0o700)
    fd = os.open(package / "__init__.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"OVERRIDES = {json.dumps(list(secret))!r}  # JSON, read by gspo-ray train\n")
    return package, name


def secret_overrides_from_env() -> list[str]:
    """The overrides `submit` handed to the job in its secret module (none outside a submitted job), read once:
    the module is then forgotten (`forget_secret_module`)."""
    name = os.environ.get(SECRET_MODULE_ENV)
    if not name:
        return []
    try:
        module = importlib.import_module(name)
        raw = module.OVERRIDES
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{SECRET_MODULE_ENV}={name}: the job's secret overrides did not arrive with it "
                          f"({type(e).__name__}: {e}); submit it again with gspo-ray submit") from None
    forget_secret_module(name, Path(module.__file__).parent)
    return [str(o) for o in json.loads(raw)]


def forget_secret_module(name: str, package: Path) -> None:
    """Once the driver has read its secret module: Ray unpacked the package on the driver's node with default
    permissions (its zip extraction keeps no 0600), and would unpack it on every node that runs one of the job's
    actors, a job's py_modules being every actor's. So the module leaves the import cache, its unpacked files
    leave this node's disk, and its package leaves the runtime_env this process's `ray.init` gives the actors
    (Ray's job config in the environment), with the variable naming it. The zip stays in the cluster's GCS until
    the job ends (Ray deletes a job's packages then): readable meanwhile by a client of the cluster that knows its
    URI, which can run code on the cluster anyway (docs/cluster.md)."""
    import shutil
    import sys

    sys.modules.pop(name, None)
    importlib.invalidate_caches()
    shutil.rmtree(package, ignore_errors=True)
    os.environ.pop(SECRET_MODULE_ENV, None)
    raw = os.environ.get(RAY_JOB_CONFIG_ENV)
    if not raw:
        return
    job_config = json.loads(raw)
    env = job_config.get("runtime_env") or {}
    unpacked_as = package.parent.name  # Ray unpacks gcs://_ray_pkg_<hash>.zip into .../_ray_pkg_<hash>/
    kept = [uri for uri in env.get("py_modules") or [] if uri.rsplit("/", 1)[-1].removesuffix(".zip") != unpacked_as]
    if kept:
        env["py_modules"] = kept
    else:
        env.pop("py_modules", None)
    (env.get("env_vars") or {}).pop(SECRET_MODULE_ENV, None)
    os.environ[RAY_JOB_CONFIG_ENV] = json.dumps(job_config)


def build_entrypoint(config_arg: str, overrides: Sequence[str] = (), entrypoint: str = TRAIN_ENTRYPOINT,
                     resume: bool = False) -> str:
    """`gspo-ray train CONFIG key=value ... [--resume]`, each argument shell-quoted."""
    args = [*shlex.split(entrypoint), config_arg, *overrides] + (["--resume"] if resume else [])
    return shlex.join(args)


def submit(config_path: str | Path, address: str | None, overrides: Sequence[str] = (), working_dir: str | Path = ".",
           runtime_env: dict[str, Any] | None = None, job_id: str | None = None,
           entrypoint: str = TRAIN_ENTRYPOINT, resume: bool = False, validate: bool = True,
           stop_grace_s: int = DEFAULT_STOP_GRACE_S) -> str:
    """Validate the job file locally, then submit `<entrypoint> CONFIG overrides` as a Ray job. Returns its id.

    `entrypoint` is the command before the config path (`gspo-ray train`; `gspo-ray config validate` for a dry
    run on the cluster). Raises ConfigError naming the field when the file or an override is invalid.
    """
    config_path, wd = Path(config_path), Path(working_dir)
    overrides = list(overrides)
    cfg = load_config(config_path, overrides) if validate else None
    if cfg is not None and not cfg.logging.out_dir.is_absolute():
        log.warning("logging.out_dir %r is relative: the run directory lands in the job's working_dir copy on "
                    "the head and is deleted with the cluster; use shared storage", str(cfg.logging.out_dir))
    env = build_runtime_env(wd, runtime_env, cfg, stop_grace_s)
    # secret-valued overrides travel neither on the job's command line, which Ray prints at the top of the job's
    # log ("Running entrypoint for job ...") and keeps in its job record, nor in its runtime_env's env_vars, which
    # the job record keeps too (`gspo-ray jobs status`, the dashboard): they go in a module uploaded with the job,
    # of which the record holds only the package URI
    public, secret = split_secret_overrides(overrides)
    cmd = build_entrypoint(_config_arg(config_path, wd), public, entrypoint, resume)
    metadata = {"config": config_path.name} | ({"name": cfg.name} if cfg is not None else {})
    with tempfile.TemporaryDirectory(prefix="gspo-ray-submit-") as scratch:  # 0700, gone once uploaded
        if secret:
            module, name = write_secret_module(secret, Path(scratch))
            env["py_modules"] = [*env.get("py_modules", []), str(module)]
            env["env_vars"][SECRET_MODULE_ENV] = name
        job = _client(address).submit_job(entrypoint=cmd, runtime_env=env, submission_id=job_id, metadata=metadata)
    log.info("submitted %s: %s", job, shlex.join(redact_args(shlex.split(cmd))))  # no secret in a log line
    return job


def submit_command(command: str, address: str | None, working_dir: str | Path = ".",
                   runtime_env: dict[str, Any] | None = None, job_id: str | None = None) -> str:
    """Submit any shell command as a job with the project uploaded (no config involved)."""
    env = build_runtime_env(working_dir, runtime_env)
    return _client(address).submit_job(entrypoint=command, runtime_env=env, submission_id=job_id)


def status(job_id: str, address: str | None):
    """The job's `ray.job_submission.JobStatus` (PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED)."""
    return _client(address).get_job_status(job_id)


def info(job_id: str, address: str | None):
    """The job's `JobDetails` (status, message, entrypoint, start/end times, metadata)."""
    return _client(address).get_job_info(job_id)


def logs(job_id: str, address: str | None, follow: bool = False) -> Iterator[str]:
    """The driver's output: all of it so far as one chunk, or (follow) chunks as they arrive until the job ends."""
    client = _client(address)
    if not follow:
        yield client.get_job_logs(job_id)
        return
    yield from _iterate_async(client.tail_job_logs(job_id))


def _iterate_async(agen) -> Iterator[str]:
    """Drive an async generator from synchronous code on a private event loop."""
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.run_until_complete(agen.aclose())
        loop.close()


def stop(job_id: str, address: str | None) -> bool:
    """Ask the job to stop: SIGTERM to the driver (it finishes its step, saves a checkpoint and exits 143), then
    SIGKILL after the grace period set at submission (`stop_grace_s`). False when it had already finished."""
    return _client(address).stop_job(job_id)


def stop_grace_s(job_id: str, address: str | None) -> int:
    """The job's grace period between SIGTERM and SIGKILL (Ray's default 3 s for jobs not submitted here)."""
    env = (_client(address).get_job_info(job_id).runtime_env or {}).get("env_vars") or {}
    try:
        return int(env.get(STOP_GRACE_ENV, 3))
    except (TypeError, ValueError):
        return 3


def wait(job_id: str, address: str | None, timeout_s: float = 3600.0, poll_s: float = 1.0):
    """Block until the job reaches a terminal status and return it; TimeoutError names the last status seen."""
    client = _client(address)
    deadline = time.monotonic() + timeout_s
    while True:
        st = client.get_job_status(job_id)
        if st.is_terminal():
            return st
        if time.monotonic() >= deadline:
            raise TimeoutError(f"job {job_id} still {st} after {timeout_s:.0f} s")
        time.sleep(poll_s)
