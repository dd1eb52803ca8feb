"""A running job's control channel: a named Ray actor the coordinator polls between steps.

    gspo-ray scale rollout 2 --job tiny-moe-gspo --address auto

Requests are applied at step boundaries only, so a batch in flight is never cut by a membership change.
"""
from __future__ import annotations

import ray


def control_actor_name(job_name: str) -> str:
    return f"gspo-ray-control:{job_name}"


class JobControl:
    """Holds pending requests (desired rollout pool size) and the job's last reported progress."""

    def __init__(self):
        self._rollout_workers: int | None = None
        self._status: dict = {}

    def scale_rollout(self, num_workers: int) -> int:
        if num_workers < 1:
            raise ValueError(f"rollout pool size must be >= 1, got {num_workers}")
        self._rollout_workers = num_workers
        return num_workers

    def take_requests(self) -> dict:
        out = {} if self._rollout_workers is None else {"rollout_workers": self._rollout_workers}
        self._rollout_workers = None
        return out

    def report(self, status: dict) -> None:
        self._status = dict(status)

    def status(self) -> dict:
        return dict(self._status)


def start_control(job_name: str, namespace: str):
    """The job's control actor (0 CPUs; named, so other drivers of the namespace can find it)."""
    return ray.remote(num_cpus=0)(JobControl).options(name=control_actor_name(job_name), namespace=namespace,
                                                      get_if_exists=True).remote()


def find_control(job_name: str, namespace: str):
    try:
        return ray.get_actor(control_actor_name(job_name), namespace=namespace)
    except ValueError:
        raise ValueError(f"no running job named {job_name!r} in namespace {namespace!r}") from None
