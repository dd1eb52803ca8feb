"""Driver of tests/cluster/test_node_failure.py: joins the cluster at argv[1] and runs the tiny recipe, asking the
test (which owns the nodes) to kill the node that hosts a pool, through files in the folder argv[2]:

    after step 1: touches pools_up (the test then adds the spare nodes)

    rollout: the worker's 3rd batch stops halfway (half its prompts sampled), writes kill_rollout.json {"pid"} and
             waits there: its node is lost mid-batch. Its replacement (same class) samples normally.
    trainer: after step 5, kill_trainer.json {"pid": trainer rank 0's pid}, waited for until kill_trainer.done.

The rest of argv are config overrides. Prints `SUMMARY {json}` at the end.
"""
import json
import os
import sys
import time
from pathlib import Path

import ray

from gspo_ray.config import load_config
from gspo_ray.coordinator.job import prepare_model, run_job
from gspo_ray.coordinator.pools import rollout_actor_options, rollout_config
from gspo_ray.rollout.worker import RolloutWorker


class StallingRolloutWorker(RolloutWorker):
    """A real rollout worker whose node is lost in the middle of its 3rd batch (the first worker only)."""

    def __init__(self, *args, events: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.events, self.calls = Path(events), 0

    def generate(self, prompts, n=None, **kwargs):
        self.calls += 1
        request = self.events / "kill_rollout.json"
        if self.calls == 3 and not request.exists():
            super().generate(prompts[: len(prompts) // 2], n, **kwargs)  # work the node loss throws away
            request.write_text(json.dumps({"pid": os.getpid()}))
            time.sleep(600)  # the node dies here
        return super().generate(prompts, n, **kwargs)


def ask_for_kill(events: Path, what: str, pid: int, timeout_s: float = 180) -> None:
    (events / f"kill_{what}.json").write_text(json.dumps({"pid": pid}))
    deadline = time.monotonic() + timeout_s
    while not (events / f"kill_{what}.done").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test did not kill the {what} node within {timeout_s} s")
        time.sleep(0.2)


def main() -> None:
    address, events, overrides = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    cfg = load_config("gspo_ray/recipes/tiny_moe.yaml", overrides)
    seen: list[int] = []

    def hook(coord, step):
        seen.append(step)
        if step == 1:
            (events / "pools_up").touch()  # the pools are placed: spare nodes may join now
        if step == 5 and not (events / "kill_trainer.json").exists():
            pid = ray.get(coord.trainer.workers[0].__ray_call__.remote(lambda self: os.getpid()), timeout=60)
            ask_for_kill(events, "trainer", pid)

    ray.init(address=address, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker class travels to the actors
    actor = ray.remote(StallingRolloutWorker).options(**rollout_actor_options(cfg))
    model, r = str(prepare_model(cfg)), rollout_config(cfg)

    def make_worker(wid: int):
        return actor.remote(wid, model, r, str(cfg.run_dir), reward_runner=r.reward, events=str(events))

    try:
        summary = run_job(cfg, rollout_factory=make_worker, after_step=hook)
    finally:
        ray.shutdown()
    print("SUMMARY " + json.dumps({"steps": summary.steps, "seen": seen, "run_dir": str(cfg.run_dir)}), flush=True)


if __name__ == "__main__":
    main()
