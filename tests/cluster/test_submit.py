"""Job submission against a real local cluster (head + one worker node, started and stopped by its handle), and
the Slurm script run end to end on this machine with stand-ins for `srun`/`scontrol`.

The first tests need no cluster: a bad job file must fail before anything is contacted.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gspo_ray.cli import submission as jobs
from gspo_ray.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from cluster.local_cluster import LocalCluster  # noqa: E402
from gspo_ray.coordinator.ray_node import alive, descendants, find_free_port_block, find_free_ports  # noqa: E402

RECIPE = "gspo_ray/recipes/tiny_moe.yaml"
UNREACHABLE = "http://127.0.0.1:9"  # discard port: any attempt to submit would fail with a connection error
VENV_BIN = Path(sys.executable).parent


# -- no cluster ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, field", [("trainer.tp=3", "trainer.tp"),
                                             ("rollout.group_size=1", "rollout.group_size"),
                                             ("coordinator.stepz=2", "coordinator.stepz")])
def test_bad_job_fails_before_submission(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        jobs.submit(ROOT / RECIPE, UNREACHABLE, [override], working_dir=ROOT)


def test_runtime_env_clash_is_reported_with_the_field():
    with pytest.raises(ConfigError, match=r"cluster\.runtime_env\.env_vars\.X"):
        jobs.submit(ROOT / RECIPE, UNREACHABLE, ["cluster.runtime_env={env_vars: {X: '1'}}"], working_dir=ROOT,
                    runtime_env={"env_vars": {"X": "2"}})


def test_runtime_env_and_entrypoint():
    env = jobs.build_runtime_env(ROOT, {"env_vars": {"A": "1"}, "excludes": ["data/"], "pip": ["x"]})
    assert env["working_dir"] == str(ROOT) and env["pip"] == ["x"]
    assert ".venv" in env["excludes"] and "data/" in env["excludes"]
    assert env["env_vars"] == {"RAY_OVERRIDE_JOB_RUNTIME_ENV": "1", "RAY_JOB_STOP_WAIT_TIME_S": "300", "A": "1"}
    cmd = jobs.build_entrypoint(RECIPE, ["rollout.resources={rollout_node: 1}"], resume=True)
    assert cmd == f"gspo-ray train {RECIPE} 'rollout.resources={{rollout_node: 1}}' --resume"
    # The config path is given relative to the uploaded working_dir.
    assert jobs._config_arg(ROOT / RECIPE, ROOT) == RECIPE


def test_secret_overrides_leave_the_command_line_for_a_private_module(monkeypatch, tmp_path):
    overrides = ["coordinator.steps=2", "cluster.runtime_env.env_vars.HF_TOKEN=hf_x", "data.url=https://u:p@h/x"]
    public, secret = jobs.split_secret_overrides(overrides)
    assert public == ["coordinator.steps=2"] and secret == overrides[1:]
    path, name = jobs.write_secret_module(secret, tmp_path)
    assert path.name == name and (path / "__init__.py").stat().st_mode & 0o777 == 0o600
    # in the job, Ray's py_modules puts the module's directory on the path and the env var names it
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(jobs.SECRET_MODULE_ENV, name)
    assert jobs.secret_overrides_from_env() == secret  # what `gspo-ray train` appends in the job
    monkeypatch.setenv(jobs.SECRET_MODULE_ENV, "gspo_ray_job_missing")
    with pytest.raises(ConfigError, match="did not arrive"):
        jobs.secret_overrides_from_env()
    monkeypatch.delenv(jobs.SECRET_MODULE_ENV)
    assert jobs.secret_overrides_from_env() == []


def test_the_driver_forgets_the_secret_module_once_read(monkeypatch, tmp_path):
    """Ray unpacks a py_modules zip with default permissions, on the driver's node and on every node that runs one
    of the job's actors: once read, the module leaves the driver's import cache and disk, and the runtime_env the
    driver passes on to its actors (Ray's job config in the environment) no longer carries it."""
    import sys

    secret = ["cluster.runtime_env.env_vars.HF_TOKEN=hf_x"]
    unpacked = tmp_path / "runtime_resources" / "py_modules_files" / "_ray_pkg_5ec2e7"  # as Ray lays it out
    unpacked.mkdir(parents=True)
    path, name = jobs.write_secret_module(secret, unpacked)
    job_config = {"runtime_env": {"working_dir": "gcs://_ray_pkg_0de.zip",
                                  "py_modules": ["gcs://_ray_pkg_5ec2e7.zip", "gcs://_ray_pkg_other.zip"],
                                  "env_vars": {jobs.SECRET_MODULE_ENV: name, "A": "1"}}, "metadata": {}}
    monkeypatch.setenv(jobs.RAY_JOB_CONFIG_ENV, json.dumps(job_config))
    monkeypatch.setenv(jobs.SECRET_MODULE_ENV, name)
    monkeypatch.syspath_prepend(str(unpacked))
    assert jobs.secret_overrides_from_env() == secret
    assert name not in sys.modules and not path.exists() and jobs.SECRET_MODULE_ENV not in os.environ
    env = json.loads(os.environ[jobs.RAY_JOB_CONFIG_ENV])["runtime_env"]
    assert env["py_modules"] == ["gcs://_ray_pkg_other.zip"] and env["env_vars"] == {"A": "1"}
    assert env["working_dir"] == "gcs://_ray_pkg_0de.zip"


def test_credential_files_of_the_working_dir_are_never_packaged(tmp_path):
    """What Ray would upload, zipped by Ray's own packager with the excludes `submit` sends: planted credential
    files stay home at any depth, the code goes."""
    import zipfile

    from ray._private.runtime_env.packaging import create_package

    wd = tmp_path / "project"
    planted = [".env", ".env.local", "deploy/prod.env", "deploy/tls/server.pem", "keys/id_ed25519", ".netrc",
               "conf/gcp-service-account.json", "aws/credentials", ".aws/config", ".ray/auth_token"]
    kept = ["train.py", "recipes/job.yaml", "data/train.jsonl", "gspo_ray/envs/rewards.py"]
    for rel in planted + kept:
        (wd / rel).parent.mkdir(parents=True, exist_ok=True)
        (wd / rel).write_text("HF_TOKEN=hf_planted\n" if rel in planted else "x\n")
    env = jobs.build_runtime_env(wd)
    target = tmp_path / "pkg.zip"
    create_package(str(wd), target, include_gitignore=True, excludes=env["excludes"])
    names = {n.rstrip("/") for n in zipfile.ZipFile(target).namelist()}
    assert set(kept) <= names, sorted(names)
    assert not [p for p in planted if p in names], sorted(names)


def test_cli_submit_reports_bad_field(monkeypatch):
    from typer.testing import CliRunner

    from gspo_ray.cli.jobs import jobs_app

    monkeypatch.chdir(ROOT)
    res = CliRunner().invoke(jobs_app, ["submit", RECIPE, "trainer.ep=3", "--address", UNREACHABLE])
    assert res.exit_code == 2 and "trainer.ep" in res.output


# -- a local cluster -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(num_worker_nodes=1, head_cpus=2, worker_cpus=1, worker_resources={"rollout_node": 1},
                     base_dir=tmp_path_factory.mktemp("ray"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.mark.slow
def test_the_cluster_answers_only_its_own_token(cluster, tmp_path):
    """The nodes listen on the host's address: the dashboard and the GCS refuse a client without this cluster's
    token (none, or the machine's ~/.ray/auth_token), and the token file is the owner's alone."""
    import stat
    import urllib.error
    import urllib.request

    assert stat.S_IMODE(cluster.token_path.stat().st_mode) == 0o600
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(cluster.token_path)  # the owner presents it while it runs
    url = f"{cluster.dashboard_url}/api/v0/nodes?limit=10"
    for headers in ({}, {"Authorization": "Bearer " + "0" * 64}):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5)
        assert refused.value.code in (401, 403), refused.value.code
    assert len(cluster.alive_nodes()) == 2  # with the token
    wrong = tmp_path / "wrong_token"
    wrong.write_text("1" * 64)
    code = "import ray, sys; ray.init(address=sys.argv[1]); print('CONNECTED')"
    # 3 connection attempts instead of Ray's 20 (~1 s apart): a refused client fails in ~3 s instead of ~20; the
    # owner's own client, with the right token, connects on its first
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(wrong), "RAY_NUM_REDIS_GET_RETRIES": "3"}
    proc = subprocess.run([sys.executable, "-c", code, cluster.address], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode != 0 and "CONNECTED" not in proc.stdout, proc.stdout[-500:]


PLANTED_ENV = ".env.gspo-submit-probe"  # a credential file in the working dir the job is submitted from


@pytest.mark.slow
def test_job_sees_both_nodes_with_shipped_code(cluster):
    planted = ROOT / PLANTED_ENV
    planted.write_text("HF_TOKEN=hf_planted_in_the_working_dir\n")
    try:
        job = jobs.submit_command("python tests/cluster/_probe_job.py", cluster.dashboard_url, working_dir=ROOT,
                                  runtime_env={"env_vars": {"GSPO_PROBE": "job"}})
    finally:
        planted.unlink()
    out = "".join(jobs.logs(job, cluster.dashboard_url, follow=True))
    assert jobs.wait(job, cluster.dashboard_url, timeout_s=120) == "SUCCEEDED", out
    probe = json.loads(next(line for line in out.splitlines() if line.startswith("PROBE "))[6:])
    assert probe["alive"] == 2
    assert probe["resources"]["CPU"] == 3 and probe["resources"]["rollout_node"] == 1
    # The entrypoint runs in the environment the cluster was started from.
    assert probe["gspo_ray_exe"] == str(VENV_BIN / "gspo-ray")
    task = probe["task"]
    unpacked = Path(task["gspo_ray"]).parents[1]  # the job's working_dir copy on the worker node
    assert (unpacked / "gspo_ray").is_dir() and not (unpacked / PLANTED_ENV).exists()  # submit's excludes
    assert task["node"] != probe["driver_node"]  # rollout_node exists only on the worker node
    assert task["env"] == "driver"  # the driver's ray.init env_vars win over the job's (no clash error)
    # The code came with the job, unpacked under the worker node's own --temp-dir.
    worker_temp = str(cluster.nodes[1].temp_dir.resolve())
    assert task["gspo_ray"].startswith(worker_temp) and "working_dir_files" in task["gspo_ray"]


@pytest.mark.slow
def test_stop_a_running_job(cluster):
    job = jobs.submit_command("sleep 600", cluster.dashboard_url, working_dir=ROOT)
    deadline = time.monotonic() + 60
    while jobs.status(job, cluster.dashboard_url) != "RUNNING":
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert jobs.stop(job, cluster.dashboard_url) is True
    assert jobs.wait(job, cluster.dashboard_url, timeout_s=60) == "STOPPED"


@pytest.mark.slow
def test_stop_waits_the_grace_period_given_at_submission(cluster, tmp_path):
    """`gspo-ray stop` = SIGTERM, then SIGKILL after the grace period fixed at submission: a driver that needs 6 s
    after SIGTERM (a step and a save) finishes with a 20 s grace; Ray's default 3 s would kill it first."""
    marker = tmp_path / "saved"
    command = f"bash -c 'trap \"sleep 6; echo ok > {marker}; exit 143\" TERM; sleep 600 & wait'"
    job = jobs.submit_command(command, cluster.dashboard_url, working_dir=ROOT,
                              runtime_env={"env_vars": {jobs.STOP_GRACE_ENV: "20"}})
    deadline = time.monotonic() + 60
    while jobs.status(job, cluster.dashboard_url) != "RUNNING":
        assert time.monotonic() < deadline
        time.sleep(0.5)
    time.sleep(1)  # the trap is set
    assert jobs.stop(job, cluster.dashboard_url) is True
    jobs.wait(job, cluster.dashboard_url, timeout_s=60)
    assert marker.read_text() == "ok\n"  # not killed at 3 s


@pytest.mark.slow
@pytest.mark.skipif(not importlib.util.find_spec("gspo_ray.rollout.worker"),
                    reason="the rollout worker is not in the tree yet")
def test_train_job_writes_metrics(cluster, tmp_path, caplog):
    secret = "hf_PLANTEDsubmit0123456789"
    with caplog.at_level("INFO", logger="gspo_ray.cli.submission"):
        job = jobs.submit(ROOT / RECIPE, cluster.dashboard_url,
                          ["coordinator.steps=2", "coordinator.eval_every=0", f"logging.out_dir={tmp_path}",
                           "logging.progress=false", f"cluster.runtime_env.env_vars.HF_TOKEN={secret}"],
                          working_dir=ROOT)
    # the logged entrypoint: the secret override is not on the command line at all (it rides in a module)
    assert "submitted" in caplog.text and secret not in caplog.text
    # ... nor in what Ray keeps of the job: its record (runtime_env included) as the job API returns it (R15)
    record = jobs.info(job, cluster.dashboard_url)
    assert record.runtime_env["env_vars"][jobs.SECRET_MODULE_ENV].startswith("gspo_ray_job_")
    assert secret not in json.dumps(record.runtime_env) and secret not in repr(record)
    try:
        status = jobs.wait(job, cluster.dashboard_url, timeout_s=300)
    except TimeoutError as e:
        jobs.stop(job, cluster.dashboard_url)
        status = str(e)
    assert status == "SUCCEEDED", "".join(jobs.logs(job, cluster.dashboard_url))[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "tiny-moe-gspo" / "metrics.jsonl").read_text().splitlines()]
    trained = {r["step"] for r in rows if any(k.startswith("train/") for k in r)}
    assert {1, 2} <= trained
    # the job as `gspo-ray jobs` shows it: its status, and the driver's log ending with the run's summary
    from typer.testing import CliRunner

    from gspo_ray.cli.jobs import jobs_app

    res = CliRunner().invoke(jobs_app, ["status", job, "--address", cluster.dashboard_url])
    assert res.exit_code == 0 and f"{job}: SUCCEEDED" in res.output
    res = CliRunner().invoke(jobs_app, ["logs", job, "--address", cluster.dashboard_url])
    assert res.exit_code == 0 and f"run dir     {tmp_path / 'tiny-moe-gspo'}" in res.output, res.output[-2000:]
    assert "steps       2 (" in res.output and secret not in res.output  # the driver's log
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    # ... yet the job had it: the override came through the job's module (its config copy says redacted)
    assert "HF_TOKEN: <redacted>" in (tmp_path / "tiny-moe-gspo" / "config.yaml").read_text()


@pytest.mark.slow
def test_cluster_stop_ends_exactly_its_own_processes(cluster):
    """Runs last against the shared cluster: stop() must leave nothing of it behind and nothing else touched."""
    bystander = subprocess.Popen(["sleep", "120"])  # not the cluster's: must survive
    try:
        job = jobs.submit_command("sleep 600", cluster.dashboard_url, working_dir=ROOT)  # orphaned by stop()
        deadline = time.monotonic() + 60
        while jobs.status(job, cluster.dashboard_url) != "RUNNING":
            assert time.monotonic() < deadline
            time.sleep(0.5)
        pids = cluster.pids()
        assert len(pids) > 10  # head and worker node processes, agents, workers, the job
        t0 = time.monotonic()
        cluster.stop()
        assert time.monotonic() - t0 < 30
        assert [p for p in pids if alive(p)] == []
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


# -- Slurm script on this machine ------------------------------------------------------------------------------
SHIMS = {
    # `srun [--opt=value ...] cmd ...` -> run cmd here (the script always writes options as --opt=value).
    "srun": '#!/bin/bash\nwhile [[ "${1:-}" == -* ]]; do shift; done\nexec "$@"\n',
    "scontrol": '#!/bin/bash\necho localhost\n',
}


def _slurm_env(tmp_path, entrypoint: str, cpus: int) -> tuple[dict, Path]:
    """The environment the Slurm script runs with here: stand-in srun/scontrol, free ports, its own token."""
    for name, body in SHIMS.items():
        (tmp_path / name).write_text(body)
        (tmp_path / name).chmod(0o755)
    rng, taken = random.Random(), set()
    gcs, dash, nm, om, agent, agent_grpc, renv, metrics, client = find_free_ports(9, taken, rng)
    lo, hi = find_free_port_block(64, taken, rng)
    temp = Path(f"/tmp/gspo-slurm-{os.getpid()}-{rng.randrange(1 << 30)}")
    token = tmp_path / "auth_token"  # the script runs Ray with token auth on; ~/.ray/auth_token may be world-readable
    token.write_text("gspo-test-token")
    token.chmod(0o600)
    env = {**os.environ, "PATH": f"{tmp_path}:{VENV_BIN}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "localhost",
           "RAY_AUTH_TOKEN_PATH": str(token),
           "SLURM_JOB_ID": "t1", "SLURM_CPUS_PER_TASK": str(cpus), "GPUS_PER_NODE": "0", "RAY_PORT": str(gcs),
           "RAY_DASHBOARD_PORT": str(dash), "RAY_TMPDIR": str(temp), "RAY_START_TIMEOUT_S": "120",
           "GSPO_ENTRYPOINT": entrypoint,
           "RAY_HEAD_ARGS": f"--node-manager-port={nm} --object-manager-port={om} --dashboard-agent-listen-port="
                            f"{agent} --dashboard-agent-grpc-port={agent_grpc} --runtime-env-agent-port={renv} "
                            f"--metrics-export-port={metrics} --ray-client-server-port={client} "
                            f"--object-store-memory=134217728 --min-worker-port={lo} --max-worker-port={hi}"}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_MODE", None)  # the script's default (token) is what is tested
    env.pop("RAY_AUTH_TOKEN", None)
    return env, temp


def _start_slurm_script(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(ROOT / "deploy/slurm/gspo_ray.sbatch"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish_slurm_script(proc: subprocess.Popen, temp: Path, timeout_s: float) -> tuple[str, set[int]]:
    """Its output and the processes of its cluster that outlived it (killed here, after a grace period)."""
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        out = "(timed out)"
    finally:
        leftovers = set(descendants([proc.pid]))
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # A node's last processes exit a moment after its `ray start` returns.
        deadline = time.monotonic() + 10
        while (leftovers := {p for p in leftovers | _processes_mentioning(str(temp)) if alive(p)}) \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
    return out, leftovers


@pytest.mark.slow
def test_slurm_script_single_node(tmp_path):
    """One node: head with both pool resources, the entrypoint run as the driver, then the cluster is stopped."""
    env, temp = _slurm_env(tmp_path, "gspo-ray config validate", cpus=1)
    proc = _start_slurm_script(env, RECIPE)
    out, leftovers = _finish_slurm_script(proc, temp, timeout_s=240)
    assert proc.returncode == 0, out[-4000:]
    assert "ray: 1/1 nodes alive" in out and f"{RECIPE}: ok" in out and "stopping the Ray cluster" in out, out[-4000:]
    assert f"ray auth: token ({tmp_path / 'auth_token'})" in out  # and the node count above went through the token
    assert not leftovers, f"processes of the script's cluster outlived it: {leftovers}"


@pytest.mark.slow
def test_slurm_sigterm_to_the_script_saves_the_step_reached_then_stops_the_cluster(tmp_path):
    """What Slurm's `--signal=B:TERM@300` (the time limit near) or `scancel --batch --signal=TERM` does: the batch
    shell alone gets SIGTERM. The driver (a real tiny job) saves at its next step boundary and exits 143, the exit
    code of the script, and only then is the cluster stopped. Before: bash held the trap until the driver ended."""
    from gspo_ray.coordinator.checkpoint import CheckpointManager

    env, temp = _slurm_env(tmp_path, "gspo-ray train", cpus=2)
    runs = tmp_path / "runs"
    proc = _start_slurm_script(env, RECIPE, f"logging.out_dir={runs}", "name=slurm-term", "logging.progress=false",
                               "logging.plot=false", "logging.tensorboard=false", "logging.export_hf=none",
                               "coordinator.eval_every=0", "data.num_eval=0", "coordinator.checkpoint_every=1000",
                               "coordinator.steps=2000", "coordinator.early_stop_reward=null")
    metrics = runs / "slurm-term" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            proc.send_signal(signal.SIGTERM)  # the script only: the driver and the Ray node are its children
            break
        time.sleep(0.5)
    out, leftovers = _finish_slurm_script(proc, temp, timeout_s=240)
    assert proc.returncode == 143, out[-4000:]
    assert "asking the driver" in out and "stopping the Ray cluster" in out
    last = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()][-1]["step"]
    latest = CheckpointManager(runs / "slurm-term").latest()
    assert latest is not None and latest.name == f"step_{last:06d}"  # the step reached, not the last scheduled one
    assert not leftovers, f"processes of the script's cluster outlived it: {leftovers}"


def _processes_mentioning(text: str) -> set[int]:
    """PIDs whose command line contains `text` (our unique temp dir: only this test's processes match)."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if text in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                    out.add(int(entry))
            except OSError:
                pass
    return {p for p in out if alive(p)}
