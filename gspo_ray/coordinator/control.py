"""A running job's control channel: a named Ray actor the coordinator polls between steps.

    gspo-ray scale rollout 2 --job tiny-moe-gspo --address auto
    gspo-ray scale trainer 2 --job tiny-moe-gspo --address auto

`scale` waits for the job's answer (applied, or refused with the job's reason: exit 0 / 1). Requests are applied
at step boundaries only, so a batch in flight is never cut by a membership change (a rollout
worker removed while an async batch is in flight finishes its part first; a trainer resize saves a checkpoint,
rebuilds the pool at the new size and reloads it: coordinator/recovery.py).
"""
from __future__ import annotations

import ray


def control_actor_name(job_name: str) -> str:
    return f"gspo-ray-control:{job_name}"


class JobControl:
    """Holds pending requests (desired rollout and trainer pool sizes), the job's answer to each (applied, or
    refused with the job's reason) and the job's last reported progress. `gspo-ray scale` waits on `answer_of`."""

    def __init__(self):
        self._pending: dict[str, tuple[int, int]] = {}  # pool key -> (request id, size), applied at the next boundary
        self._taken: dict[str, int] = {}  # pool key -> request id the job is applying now
        self._answers: dict[int, dict] = {}
        self._delivered: set[int] = set()  # answers a `scale` command fetched
        self._next_id = 0
        self._status: dict = {}

    def scale_rollout(self, num_workers: int, wait: bool = True) -> int:
        """Queue a rollout pool size; returns the request's id (see `_request`)."""
        if num_workers < 1:
            raise ValueError(f"rollout pool size must be >= 1, got {num_workers}")
        return self._request("rollout_workers", num_workers, wait)

    def scale_trainer(self, num_workers: int, wait: bool = True) -> int:
        """Trainer ranks (= data-parallel size x tp); the job checks the layout and the cluster's room. Returns the
        request's id."""
        if num_workers < 1:
            raise ValueError(f"trainer pool size must be >= 1, got {num_workers}")
        return self._request("trainer_workers", num_workers, wait)

    def _request(self, key: str, size: int, wait: bool) -> int:
        """`wait`: someone fetches the answer (`scale` without --no-wait), which the job's end waits for."""
        self._next_id += 1
        if not wait:
            self._delivered.add(self._next_id)
        if key in self._pending:  # two requests before one boundary: the later one wins, the earlier is told
            self._answers[self._pending[key][0]] = {"applied": False,
                                                    "reason": f"superseded by request {self._next_id}"}
        self._pending[key] = (self._next_id, size)
        return self._next_id

    def take_requests(self) -> dict:
        """`{pool key: size}` to apply now; the job answers each with `answer`."""
        out = {key: size for key, (_, size) in self._pending.items()}
        self._taken.update({key: rid for key, (rid, _) in self._pending.items()})
        self._pending = {}
        return out

    def answer(self, key: str, applied: bool, reason: str = "", size: int | None = None) -> None:
        """The job's answer to the request it took for `key`: applied, or refused and why; `size`: the pool's
        size now."""
        rid = self._taken.pop(key, None)
        if rid is not None:
            self._answers[rid] = {"applied": bool(applied), "reason": reason, "size": size}

    def pending(self) -> dict:
        """`{pool key: size}` queued for the next step boundary."""
        return {key: size for key, (_, size) in self._pending.items()}

    def answer_of(self, request_id: int) -> dict | None:
        """None while the request waits for a step boundary."""
        answer = self._answers.get(request_id)
        if answer is not None:
            self._delivered.add(request_id)
        return answer

    def close(self) -> int:
        """The job ends: requests it will never apply are refused; returns how many answers no one fetched yet."""
        for rid in [rid for rid, _ in self._pending.values()] + list(self._taken.values()):
            self._answers[rid] = {"applied": False, "reason": "the job ended before the next step boundary"}
        self._pending, self._taken = {}, {}
        return len(set(self._answers) - self._delivered)

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
    import time

    try:  # a `scale` command waiting on an answer of the last step boundary gets it first (up to 5 s)
        deadline = time.monotonic() + 5
        while ray.get(control.close.remote(), timeout=5) and time.monotonic() < deadline:
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - already gone: nothing to wait for
        pass
    try:
        ray.kill(control)
    except Exception:  # already gone with the cluster: nothing to free
        pass


def find_control(job_name: str, namespace: str):
    try:
        return ray.get_actor(control_actor_name(job_name), namespace=namespace)
    except ValueError:
        raise ValueError(f"no running job named {job_name!r} in namespace {namespace!r}") from None


def resize_pool(coord, key: str, size: int, rescale_trainer=None) -> tuple[bool, str, dict[str, float]]:
    """Apply one pool size at a step boundary, the path `gspo-ray scale` and the autoscaler share: `key` is
    "rollout_workers" or "trainer_workers"; `rescale_trainer(n)` resizes the trainer pool (checkpoint, rebuild,
    reload) and returns a `recovery.Resize`. Returns (applied, the refusal's reason or "", the step's metrics);
    each refusal returns its own reason (the log is not read back)."""
    metrics: dict[str, float] = {}
    reason = None
    try:
        if key == "rollout_workers":
            reason = rollout_room_problem(coord, size)
            if reason is None:
                metrics.update(coord.rollout.scale(size))
        elif rescale_trainer is not None:
            result = rescale_trainer(size)
            metrics.update(result.metrics)
            reason = result.refused
        else:
            reason = "this job cannot resize its trainer pool"
    except ValueError as e:  # a size the pool refuses outright
        reason = str(e)
    except ray.exceptions.GetTimeoutError as e:
        # the room was taken between the check and the start: the new workers were stopped (_start_workers)
        reason = f"the new rollout workers did not start in time ({e}); the pool stays at {coord.rollout.num_workers}"
    pool = coord.rollout if key == "rollout_workers" else coord.trainer
    if reason is None and pool.num_workers != size:
        reason = f"the pool stayed at {pool.num_workers}"
    return reason is None, reason or "", metrics


def rollout_room_problem(coord, size: int) -> str | None:
    """Why the cluster cannot take the workers a rollout grow to `size` adds (None: it can, or it is no grow),
    found within `rollout.placement_timeout_s` and before any actor is made (rollout_pool.room_for)."""
    from gspo_ray.coordinator.pools import engine_resources, rollout_config
    from gspo_ray.coordinator.rollout_pool import room_for

    more = size - coord.rollout.num_workers
    if more <= 0:
        return None
    r = rollout_config(coord.cfg)
    res = engine_resources(r)
    bundle = {"CPU": res["num_cpus"], "GPU": res["num_gpus"], **r.resources}
    if room_for(bundle, more, r.placement_timeout_s):
        return None
    ask = ", ".join(f"{v:g} {k}" for k, v in bundle.items() if v)
    return (f"the cluster has no room for {more} more rollout worker(s) of {ask} each within "
            f"rollout.placement_timeout_s ({r.placement_timeout_s:g} s); the pool stays at "
            f"{coord.rollout.num_workers}")
