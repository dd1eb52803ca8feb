"""Deployment files are checked here, without a cluster: KubeRay manifests against the repo's KubeRay schema and
their pod templates against the Kubernetes Pod schema; cloud-launcher YAMLs against the schema and checks that
`ray up` itself applies; the entrypoints' job files against gspo-ray's config; the Slurm script with `bash -n`.
Secure defaults: Ray token auth on everywhere, the dashboard bound to localhost (Slurm, launcher) or reachable only
through the NetworkPolicy (KubeRay), pods and image non-root; the Slurm script's token handling runs with
stand-ins for srun/scontrol/ray.
"""
from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gspo_ray.config import load_config

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "deploy" / "kuberay"
SCHEMA = json.loads((KUBERAY / "schema" / "ray.io_v1.schema.json").read_text())
MANIFESTS = ["raycluster.yaml", "rayjob.yaml"]
LAUNCHERS = ["gpu_aws.yaml", "gpu_gcp.yaml"]
K8S_VERSION = "1.30"
POOLS = {"rollout": "rollout_node", "trainer": "trainer_node"}


def _load(name: str) -> dict:
    return yaml.safe_load((KUBERAY / name).read_text())


def _cluster_spec(doc: dict) -> dict:
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def _templates(doc: dict) -> list[tuple[str, dict]]:
    spec = _cluster_spec(doc)
    out = [("head", spec["headGroupSpec"]["template"])]
    out += [(g["groupName"], g["template"]) for g in spec.get("workerGroupSpecs", [])]
    return out


def _start_resources(group: dict) -> dict[str, float]:
    """rayStartParams.resources as `ray start --resources` receives it after the shell has unquoted it."""
    raw = group.get("rayStartParams", {}).get("resources")
    return json.loads(shlex.split(raw)[0]) if raw else {}


def _gpus(template: dict) -> int:
    return sum(int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
               for c in template["spec"]["containers"])


# -- KubeRay ---------------------------------------------------------------------------------------------------
def test_schema_is_valid_and_rejects_typos():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    doc = _load("rayjob.yaml")
    doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["maxReplica"] = 3  # misspelt maxReplicas
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        jsonschema.validate(doc, SCHEMA)
    doc = _load("raycluster.yaml")
    doc["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # KubeRay wants strings here
    with pytest.raises(jsonschema.ValidationError, match="not of type 'string'"):
        jsonschema.validate(doc, SCHEMA)


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_matches_kuberay_schema(name):
    jsonschema.Draft202012Validator(SCHEMA).validate(_load(name))


@pytest.mark.parametrize("name", MANIFESTS)
def test_pod_templates_are_valid_kubernetes_pods(name):
    for group, template in _templates(_load(name)):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"gspo-{group}",
                                                                **template.get("metadata", {})},
               "spec": template["spec"]}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_pod_validation_catches_a_bad_template():
    _, template = _templates(_load("raycluster.yaml"))[1]
    template["spec"]["containers"][0]["resource"] = {}  # misspelt `resources`
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": template["spec"]}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", MANIFESTS)
def test_separate_gpu_pools_with_shm_and_autoscaling(name):
    spec = _cluster_spec(_load(name))
    assert spec["enableInTreeAutoscaling"] is True
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == set(POOLS)
    for group_name, resource in POOLS.items():
        g = groups[group_name]
        gpus = _gpus(g["template"])
        assert gpus >= 1, f"{group_name}: no nvidia.com/gpu limit"
        # Only its own pool's resource: one unit per trainer GPU (a rank each), one per rollout pod (an engine
        # each, of the pod's GPUs: a TP-k engine's GPUs must share a node)
        assert _start_resources(g) == {resource: gpus if group_name == "trainer" else 1}
        resources = g["template"]["spec"]["containers"][0]["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"], group_name
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"] and g["maxReplicas"] > g["minReplicas"]
    for group_name, template in _templates(_load(name)):
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        mounts = {m["mountPath"]: m["name"] for c in template["spec"]["containers"] for m in c["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", group_name
        # The run directory must be the same shared volume everywhere (trainer ranks all write checkpoints).
        assert "persistentVolumeClaim" in volumes[mounts["/mnt/runs"]], group_name
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def _engine_fits_a_rollout_pod(doc: dict, cfg) -> None:
    """One engine per rollout pod, on all of its GPUs: the engine's GPUs (rollout.tensor_parallel_size; an actor and
    its TP workers live on one node) are the pod's, else it can never be placed or leaves GPUs idle."""
    from gspo_ray.coordinator.pools import engine_resources, rollout_config

    groups = {g["groupName"]: g for g in doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    pod_gpus = _gpus(groups["rollout"]["template"])
    assert engine_resources(rollout_config(cfg))["num_gpus"] == pod_gpus, \
        f"an engine of {cfg.rollout.tensor_parallel_size} GPUs on rollout pods of {pod_gpus}"


def test_a_tp2_engine_fits_once_the_rollout_pods_gpus_say_2():
    """The rollout pods' GPU count is one value (a YAML anchor): set to 2 with rollout.tensor_parallel_size=2 in the
    entrypoint, a TP-2 engine fits a pod; at 1 it cannot be placed."""
    text = (KUBERAY / "rayjob.yaml").read_text()
    assert text.count('&rollout_gpus "1"') == 1
    doc = yaml.safe_load(text.replace('&rollout_gpus "1"', '&rollout_gpus "2"'))
    resources = doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == "2"
    argv = shlex.split(doc["spec"]["entrypoint"])
    overrides = [a for a in argv[3:] if not a.startswith("--")]
    tp2 = load_config(ROOT / argv[2], [*overrides, "rollout.tensor_parallel_size=2"])
    _engine_fits_a_rollout_pod(doc, tp2)
    with pytest.raises(AssertionError, match="an engine of 2 GPUs on rollout pods of 1"):
        _engine_fits_a_rollout_pod(_load("rayjob.yaml"), tp2)


def test_rayjob_entrypoint_is_a_valid_job_that_fits_the_cluster():
    doc = _load("rayjob.yaml")
    spec = doc["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["gspo-ray", "train"]
    flags = [a for a in argv[3:] if a.startswith("--")]
    assert flags == ["--resume"]  # re-applying the manifest continues the run instead of refusing the run dir
    cfg = load_config(ROOT / argv[2], [a for a in argv[3:] if a not in flags])  # ConfigError names a bad knob
    assert cfg.logging.out_dir.is_absolute()
    groups = {g["groupName"]: g for g in spec["rayClusterSpec"]["workerGroupSpecs"]}
    for pool, sub in (("rollout", cfg.rollout), ("trainer", cfg.trainer)):
        g = groups[pool]
        assert sub.num_gpus_per_worker > 0
        assert set(sub.resources) == {POOLS[pool]}
        # Everything the pool asks for fits in the group at its largest.
        per_pod = min(_gpus(g["template"]) / sub.num_gpus_per_worker,
                      _start_resources(g)[POOLS[pool]] / sub.resources[POOLS[pool]])
        assert sub.num_workers <= int(per_pod) * g["maxReplicas"], pool
    _engine_fits_a_rollout_pod(doc, cfg)
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0
    env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert env["env_vars"]["RAY_OVERRIDE_JOB_RUNTIME_ENV"] == "1"


def test_rayversion_matches_installed_ray():
    import ray

    for name in MANIFESTS:
        assert _cluster_spec(_load(name))["rayVersion"] == ray.__version__, name


# -- cloud launcher --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_yaml_passes_ray_validation(name):
    import copy

    from ray.autoscaler._private.util import prepare_config, validate_config

    doc = yaml.safe_load((ROOT / "cluster" / "launcher" / name).read_text())
    schema_path = Path(__import__("ray.autoscaler", fromlist=["x"]).__file__).parent / "ray-schema.json"
    jsonschema.validate(doc, json.loads(schema_path.read_text()))
    validate_config(doc)
    # What `ray up` does before it talks to the cloud: merge the provider defaults, then validate again.
    validate_config(prepare_config(copy.deepcopy(doc)))


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_has_separate_gpu_pools(name):
    doc = yaml.safe_load((ROOT / "cluster" / "launcher" / name).read_text())
    types = doc["available_node_types"]
    head = types[doc["head_node_type"]]
    assert not set(head["resources"]) & set(POOLS.values())
    for resource in POOLS.values():
        (pool,) = [t for t in types.values() if resource in t["resources"]]
        assert pool["resources"]["GPU"] >= 1
        assert pool["resources"][resource] == pool["resources"]["GPU"]
        assert not set(pool["resources"]) & (set(POOLS.values()) - {resource})
        assert pool["min_workers"] < pool["max_workers"]
    assert sum(t.get("max_workers", 0) for t in types.values()) <= doc["max_workers"]


def test_launcher_schema_catches_a_bad_node_type():
    from ray.autoscaler._private.util import validate_config

    doc = yaml.safe_load((ROOT / "cluster" / "launcher" / "gpu_aws.yaml").read_text())
    doc["available_node_types"]["rollout_gpu"]["resources"]["rollout_node"] = 0.5  # launcher wants integers
    with pytest.raises(jsonschema.ValidationError):
        validate_config(doc)


# -- Slurm and the image ---------------------------------------------------------------------------------------
def test_sbatch_script_parses():
    script = ROOT / "deploy" / "slurm" / "gspo_ray.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert not re.search(r"^\s*ray stop", text, re.M), "never `ray stop` on shared nodes"
    assert re.search(r"^#SBATCH --nodes=", text, re.M)


def test_dockerfile_builds_from_cuda_with_the_cuda_extra():
    text = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+-devel-", text, re.M)
    extra = re.search(r"^ARG EXTRAS=(\S+)", text, re.M).group(1)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert extra in pyproject["project"]["optional-dependencies"]
    assert 'pip install --no-build-isolation -e ".[${EXTRAS}]"' in text
    for src in re.findall(r"^COPY (.+) \S+$", text, re.M):  # every COPY source exists in the build context
        for part in (p for p in src.split() if not p.startswith("--")):
            assert (ROOT / part).exists(), part
    assert "wget" in text  # KubeRay's probes need it


def test_dockerfile_install_step_installs_the_cuda_lock():
    """Run the image's install RUN line with `pip` stubbed: the locked set first (all but TE's sdist), then the
    package with the extra."""
    text = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    run = re.search(r"^RUN (sed .*?no-build-isolation[^\n]*)", text, re.M | re.S).group(1)
    run = run.replace("\\\n", " ")
    stub = 'pip() { echo "PIP $*"; [ "$3" = "-r" ] && grep -c "^[a-z0-9].*==" "$4"; true; }'  # counts the lines fed
    out = subprocess.run(["sh", "-c", f"{stub}; {run}"], cwd=ROOT, capture_output=True, text=True, env={"EXTRAS": "cuda", "PATH": "/usr/bin:/bin"},
                         check=True).stdout.splitlines()
    locked = len(re.findall(r"^[a-z0-9].*==", (ROOT / "requirements" / "cuda.lock").read_text(), re.M))
    assert out == ["PIP install --no-deps -r /dev/stdin", str(locked - 1), "PIP install --no-build-isolation -e .[cuda]"]


# -- secure defaults (issue: Ray exposed without auth) ---------------------------------------------------------
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
SBATCH = ROOT / "deploy" / "slurm" / "gspo_ray.sbatch"
NAME_LABEL = {"app.kubernetes.io/name": "gspo-ray"}


def _all_templates(doc: dict) -> list[tuple[str, dict]]:
    """Every pod template of a manifest: the cluster's, and the RayJob's submitter."""
    out = _templates(doc)
    if doc["kind"] == "RayJob":
        out.append(("submitter", doc["spec"]["submitterPodTemplate"]))
    return out


def _image_uid() -> int:
    users = re.findall(r"^USER (\S+)", DOCKERFILE.read_text(), re.M)
    assert users, "the image must switch to an unprivileged user"
    return int(users[-1].split(":")[0])


@pytest.mark.parametrize("name", MANIFESTS)
def test_ray_token_auth_is_on(name):
    assert _cluster_spec(_load(name))["authOptions"] == {"mode": "token"}
    doc = _load(name)
    _cluster_spec(doc)["authOptions"]["mode"] = "none"  # the schema knows the field's values
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, SCHEMA)


@pytest.mark.parametrize("name", MANIFESTS)
def test_pods_run_as_the_images_unprivileged_user(name):
    uid = _image_uid()
    assert uid != 0
    doc = _load(name)
    for group, template in _all_templates(doc):
        spec = template["spec"]
        ctx = spec["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == uid, group
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, group
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), group
        for c in spec["containers"]:
            c_ctx = c["securityContext"]
            assert c_ctx["allowPrivilegeEscalation"] is False and c_ctx["capabilities"]["drop"] == ["ALL"], group
            assert not c_ctx.get("privileged") and c_ctx.get("runAsUser", uid) != 0, group
            assert all("hostPort" not in p for p in c.get("ports", [])), group
        if group != "head":  # user code runs in workers; only the head's autoscaler needs the Kubernetes API
            assert spec["automountServiceAccountToken"] is False, group
    autoscaler = _cluster_spec(doc)["autoscalerOptions"]["securityContext"]
    assert autoscaler["allowPrivilegeEscalation"] is False and autoscaler["capabilities"]["drop"] == ["ALL"]


@pytest.mark.parametrize("name", MANIFESTS)
def test_nothing_is_exposed_outside_the_cluster(name):
    doc = _load(name)
    head = _cluster_spec(doc)["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP" and not head.get("enableIngress")
    for group, template in _all_templates(doc):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"gspo-{group}", **template.get("metadata", {})},
               "spec": template["spec"]}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)  # the submitter's template too
        assert template["metadata"]["labels"].items() >= NAME_LABEL.items(), group  # under the NetworkPolicy


def test_network_policy_admits_only_the_clusters_own_pods_and_the_operator():
    policies = list(yaml.safe_load_all((KUBERAY / "networkpolicy.yaml").read_text()))
    for p in policies:
        kubernetes_validate.validate(p, K8S_VERSION, strict=True)
        assert p["spec"]["policyTypes"] == ["Ingress"]
    own, operator = policies
    assert own["spec"]["podSelector"] == {"matchLabels": NAME_LABEL}
    (rule,) = own["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": NAME_LABEL}}]  # same namespace, gspo-ray pods only
    assert operator["spec"]["podSelector"]["matchLabels"] == {**NAME_LABEL, "app.kubernetes.io/component": "head"}
    (rule,) = operator["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8265}]  # the dashboard, nothing else
    assert rule["from"][0]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}
    for name in MANIFESTS:  # the policy selects every pod of both manifests
        for group, template in _all_templates(_load(name)):
            assert template["metadata"]["labels"].items() >= NAME_LABEL.items(), (name, group)


def test_dockerfile_runs_as_an_unprivileged_user():
    text = DOCKERFILE.read_text()
    assert _image_uid() == 1000
    # the user switch comes before the installs, so the venv is the user's and nothing after runs as root
    assert text.index("USER 1000") < text.index("RUN python3 -m venv")
    assert "--create-home" in text and "ENV HOME=/home/ray" in text


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_turns_token_auth_on_and_keeps_the_dashboard_local(name):
    doc = yaml.safe_load((ROOT / "cluster" / "launcher" / name).read_text())
    starts = [c for c in doc["head_start_ray_commands"] + doc["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2 and all("export RAY_AUTH_MODE=token;" in c for c in starts)
    assert "--dashboard-host=127.0.0.1" in starts[0]  # `ray dashboard` reaches it through SSH
    assert doc["file_mounts"] == {"~/.ray/auth_token": "~/.ray/auth_token"}
    assert "0.0.0.0" not in (ROOT / "cluster" / "launcher" / name).read_text()


def test_sbatch_binds_the_dashboard_locally_and_defaults_to_token_auth():
    text = SBATCH.read_text()
    assert "0.0.0.0" not in text
    assert re.search(r"^export RAY_AUTH_MODE=\$\{RAY_AUTH_MODE:-token\}$", text, re.M)
    assert re.search(r"^RAY_DASHBOARD_HOST=\$\{RAY_DASHBOARD_HOST:-127\.0\.0\.1\}$", text, re.M)


RAY_STUB = """#!/bin/bash
# stands in for `ray start`: records how the script started the head node, then exits
{ echo "ARGS $*"; echo "MODE ${RAY_AUTH_MODE:-}"; echo "TOKEN_PATH ${RAY_AUTH_TOKEN_PATH:-}"
  [[ -n "${RAY_AUTH_TOKEN_PATH:-}" ]] && echo "TOKEN_PERM $(stat -L -c %a "$RAY_AUTH_TOKEN_PATH")"; } >> "$RAY_STUB_LOG"
"""


def _run_sbatch(tmp_path, **env):
    """The Slurm script up to the point where it waits for nodes (stand-ins for srun/scontrol/ray; 2 s)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shims = {"srun": '#!/bin/bash\nwhile [[ "${1:-}" == -* ]]; do shift; done\nexec "$@"\n',
             "scontrol": "#!/bin/bash\necho localhost\n", "ray": RAY_STUB}
    for name, body in shims.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "home").mkdir(exist_ok=True)
    full_env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path / "home"),
                "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "t9", "SLURM_CPUS_PER_TASK": "1",
                "GPUS_PER_NODE": "0", "RAY_START_TIMEOUT_S": "2", "RAY_TMPDIR": str(tmp_path / "ray"),
                "RAY_STUB_LOG": str(tmp_path / "ray.log"), **env}
    proc = subprocess.run(["bash", str(SBATCH), "gspo_ray/recipes/tiny_moe.yaml"], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=60)
    log = (tmp_path / "ray.log").read_text() if (tmp_path / "ray.log").exists() else ""
    return proc, log


def test_sbatch_generates_a_private_token_for_the_allocation(tmp_path):
    proc, log = _run_sbatch(tmp_path)
    token = tmp_path / "home" / ".ray" / "gspo-ray-t9.token"
    assert "ray auth: token" in proc.stdout, proc.stdout + proc.stderr
    assert f"MODE token\nTOKEN_PATH {token}\nTOKEN_PERM 600" in log
    assert "--dashboard-host=127.0.0.1" in log
    assert not token.exists()  # deleted when the allocation's cluster is stopped


def test_sbatch_refuses_a_token_other_users_can_read(tmp_path):
    token = tmp_path / "home" / ".ray" / "auth_token"
    token.parent.mkdir(parents=True)
    token.write_text("abc")
    token.chmod(0o644)  # how `ray.init()` leaves ~/.ray/auth_token under the usual umask
    proc, log = _run_sbatch(tmp_path)
    assert proc.returncode == 2 and "chmod 600" in proc.stderr and log == ""  # before any node starts
    token.chmod(0o600)
    proc, log = _run_sbatch(tmp_path)
    assert f"MODE token\nTOKEN_PATH {token}\nTOKEN_PERM 600" in log and token.exists()  # the user's own: kept


def test_sbatch_auth_can_only_be_disabled_explicitly(tmp_path):
    proc, log = _run_sbatch(tmp_path, RAY_AUTH_MODE="disabled")
    assert "warning: RAY_AUTH_MODE=disabled" in proc.stderr and "MODE disabled" in log


GSPO_STUB = """#!/bin/bash
# stands in for `gspo-ray`: `submit ... --wait` runs until `stop ID` ends it (as Ray ends a stopped job)
case "$1" in
    submit) echo "SUBMIT $*" >> "$GSPO_STUB_LOG"; echo $$ > "$GSPO_STUB_LOG.pid"
            trap 'exit 1' TERM; while :; do sleep 0.1; done ;;
    stop)   echo "STOP $2" >> "$GSPO_STUB_LOG"; kill -TERM "$(cat "$GSPO_STUB_LOG.pid")" ;;
esac
"""


def test_sbatch_submit_mode_forwards_term_to_the_ray_job(tmp_path):
    """RUN_MODE=submit: a TERM to the batch script (Slurm's --signal=B:TERM@300) stops the Ray job at once through
    `gspo-ray stop`, instead of waiting for `submit --wait` to return; the script exits 143."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shims = {"srun": '#!/bin/bash\nwhile [[ "${1:-}" == -* ]]; do shift; done\nexec "$@"\n',
             "scontrol": "#!/bin/bash\necho localhost\n", "ray": "#!/bin/bash\nexit 0\n",
             "python3": "#!/bin/bash\ncat > /dev/null; echo 1\n",  # the node count: every node is up
             "gspo-ray": GSPO_STUB}
    for name, body in shims.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    stub_log = tmp_path / "gspo.log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_NODELIST": "localhost",
           "SLURM_JOB_ID": "t9", "SLURM_CPUS_PER_TASK": "1", "GPUS_PER_NODE": "0", "RAY_START_TIMEOUT_S": "5",
           "RAY_TMPDIR": str(tmp_path / "ray"), "RAY_AUTH_MODE": "disabled", "RUN_MODE": "submit",
           "GSPO_STUB_LOG": str(stub_log)}
    proc = subprocess.Popen(["bash", str(SBATCH), "gspo_ray/recipes/tiny_moe.yaml"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (stub_log.exists() and "SUBMIT" in stub_log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, out
    submitted, stopped = stub_log.read_text().splitlines()
    job_id = submitted.split("--job-id ")[1].split()[0]
    assert job_id.startswith("gspo-ray-t9-") and stopped == f"STOP {job_id}", (submitted, stopped)
