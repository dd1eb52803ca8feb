"""A running job's control channel: a named Ray actor the coordinator polls between steps.

    gspo-ray scale rollout 2 --job tiny-moe-gspo --address auto
    gspo-ray scale trainer 2 --job tiny-moe-gspo --address auto

Requests are applied at step boundaries only, so a batch in flight is never cut by a membership change (a rollout
worker removed while an async batch is in flight finishes its part first; a trainer resize saves a checkpoint,
rebuilds the pool at the new size and reloads it: coordinator/recovery.py).
"""
from __future__ import annotations

import ray


def control_actor_name(job_name: str) -> str:
    return f"gspo-ray-control:{job_name}"


class JobControl:
    """Holds pending requests (desired rollout and trainer pool sizes) and the job's last reported progress."""

    def __init__(self):
        self._rollout_workers: int | None = None
        self._trainer_workers: int | None = None
        self._status: dict = {}

    def scale_rollout(self, num_workers: int) -> int:
        if num_workers < 1:
            raise ValueError(f"rollout pool size must be >= 1, got {num_workers}")
        self._rollout_workers = num_workers
        return num_workers

    def scale_trainer(self, num_workers: int) -> int:
        """Trainer ranks (= data-parallel size x tp); the job checks the layout and the cluster's room."""
        if num_workers < 1:
            raise ValueError(f"trainer pool size must be >= 1, got {num_workers}")
        self._trainer_workers = num_workers
        return num_workers

    def take_requests(self) -> dict:
        out = {} if self._rollout_workers is None else {"rollout_workers": self._rollout_workers}
        if self._trainer_workers is not None:
            out["trainer_workers"] = self._trainer_workers
        self._rollout_workers = self._trainer_workers = None
        return out

    def report(self, status: dict) -> None:
        self._status = dict(status)

    def status(self) -> dict:
        return dict(self._status)


class ControlNameTaken(RuntimeError):
    """A live job of the same name already runs in the namespace (its control actor answers)."""


def start_control(job_name: str, namespace: str, attempts: int = 5):
    """The job's control actor (0 CPUs, on the driver's node; named, so other drivers of the namespace can find it).

    Never shared: a live job of the same name in the namespace holds the name, and this job is refused
    (ControlNameTaken) instead of silently taking that job's `scale` requests. A dead holder (its driver gone, or
    a job that ended a moment ago) frees the name within a short retry."""
    import time

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    name = control_actor_name(job_name)
    # on the driver's node: it shares the driver's fate, and a lost worker node cannot take the job's control down
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    for i in range(attempts):
        try:
            control = ray.remote(num_cpus=0)(JobControl).options(name=name, namespace=namespace,
                                                                 scheduling_strategy=here).remote()
            # a first call now: the driver's connection to the actor is made while the pools start, not in the
            # first step (measured: a 2.4-2.8 s wait at the first control check otherwise)
            control.status.remote()
            return control
        except ValueError:  # "the name is already taken"
            try:
                other = ray.get_actor(name, namespace=namespace)
                ray.get(other.status.remote(), timeout=10)
            except (ValueError, ray.exceptions.RayError):
                time.sleep(0.5 * (i + 1))  # gone or dying: the GCS frees the name shortly
                continue
            raise ControlNameTaken(f"a job named {job_name!r} is already running in Ray namespace {namespace!r}: "
                                   "give this run another `name` or `cluster.namespace`") from None
    raise ControlNameTaken(f"could not register the control actor {name!r} in namespace {namespace!r}")


def stop_control(control) -> None:
    """End this job's control actor so the name is free for the next job (a driver that joined a cluster keeps
    its actors alive otherwise)."""
    try:
        ray.kill(control)
    except Exception:  # already gone with the cluster: nothing to free
        pass


def find_control(job_name: str, namespace: str):
    try:
        return ray.get_actor(control_actor_name(job_name), namespace=namespace)
    except ValueError:
        raise ValueError(f"no running job named {job_name!r} in namespace {namespace!r}") from None
