"""Stand-in actors for the coordinator's tests: what a pool calls on its workers, with no engine behind them.

Tests send the class to Ray's workers by value (`ray.cloudpickle.register_pickle_by_value(stand_ins)`): the test
tree is not importable there."""
from __future__ import annotations

import os


class StandInRolloutWorker:
    """What RolloutPool calls on a rollout worker at start, push and stop. `dies_under_push`: the worker ids whose
    engine process dies during a push (`update_weights`)."""

    def __init__(self, worker_id: int, dies_under_push: tuple[int, ...] = ()):
        self.worker_id = worker_id
        self.dies_under_push = dies_under_push

    def ping(self):
        return self.worker_id

    def update_weights(self, version, buckets, probe=None):
        if self.worker_id in self.dies_under_push:
            os._exit(3)  # the engine process dies under the push
        return {"sync/push_s": 0.0}

    def shutdown(self):
        return None
