"""R9: the shared-memory export is written only when a rollout engine is on trainer rank 0's node, object-store refs
when one is elsewhere or the cluster has several nodes (coordinator/loop.py export_plan), and the coordinator asks it with the pools' real
placement: trainer rank 0's placement-group bundle, each rollout actor's node (asked once per actor). The Ray side of
the node look-ups runs in tests/rollout/test_worker_pool.py and tests/trainer/test_pool.py."""
from __future__ import annotations

import pytest

from gspo_ray.config import load_config
from gspo_ray.coordinator import loop
from gspo_ray.coordinator.loop import Coordinator, LoopState, export_plan


@pytest.mark.parametrize("trainer,engines,expected", [
    ("A", ["A", "A"], (True, False)),    # one node: the file only
    ("A", ["B", "B"], (False, True)),    # separate rollout nodes: refs only, no file nobody maps
    ("A", ["A", "B"], (True, True)),     # both: the file for A's engines, refs for B's
    ("A", ["B", None], (True, True)),    # an unknown node may be A's: both
    (None, ["A"], (True, True)),         # trainer's node unknown: both, as before
])
def test_export_plan(trainer, engines, expected):
    assert export_plan(True, trainer, engines, nodes=1) == expected
    # export_shared_memory false: refs only, wherever the engines are
    assert export_plan(False, trainer, engines, nodes=1) == (False, True)
    # several nodes: refs always (a replacement engine may land elsewhere); the file still only where read
    assert export_plan(True, trainer, engines, nodes=3) == (expected[0], True)


class _Export:
    shared, buckets = None, ["ref"]


class _Trainer:
    pg = object()  # stands for the trainer pool's placement group

    def __init__(self):
        self.calls = []

    def export_weights(self, **kw):
        self.calls.append(kw)
        return _Export()


class _Rollout:
    def __init__(self, workers):
        self.workers = workers

    def push_weights(self, version, buckets, probe=None):
        return {}


def test_sync_weights_asks_shared_false_when_engines_are_on_another_node(monkeypatch):
    asked = []
    nodes = {"w0": "node-B", "w1": "node-B", "w2": "node-A"}
    monkeypatch.setattr(loop, "placement_node", lambda pg, bundle: "node-A" if bundle == 0 else "?")
    monkeypatch.setattr(loop, "actor_node_ids", lambda handles: asked.extend(handles) or [nodes[h] for h in handles])
    monkeypatch.setattr(loop, "cluster_nodes", lambda: 2)
    cfg = load_config(None, ["rollout.verify_push=false"])
    trainer, rollout = _Trainer(), _Rollout({0: "w0", 1: "w1"})
    coord = Coordinator(cfg, rollout, trainer, None, LoopState())
    coord.sync_weights()
    assert trainer.calls[-1] == {"as_refs": True, "shared": False}
    coord.sync_weights()
    assert asked == ["w0", "w1"]  # an actor's node is asked once
    rollout.workers[2] = "w2"  # scaled up (or a replacement) on trainer rank 0's node: the file too
    coord.sync_weights()
    assert trainer.calls[-1] == {"as_refs": True, "shared": True} and asked == ["w0", "w1", "w2"]
    del rollout.workers[2]
    rollout.workers[3] = "w3"  # did not answer: may be anywhere, so the file and refs, and it is asked again
    nodes["w3"] = None
    coord.sync_weights()
    assert trainer.calls[-1] == {"as_refs": True, "shared": True}
    nodes["w3"] = "node-B"
    coord.sync_weights()
    assert trainer.calls[-1] == {"as_refs": True, "shared": False} and asked[-2:] == ["w3", "w3"]
