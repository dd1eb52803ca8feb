"""Colocated pools placed by real Ray on CPU, 4 GPUs declared to Ray (none exist: Ray hands out their ids and sets
CUDA_VISIBLE_DEVICES as on a GPU node), with actors standing in for the trainer ranks and for CUDA engines (vLLM's
sleep mode has no CPU implementation). One Ray instance for the module (~7 s)."""
import os
import sys
import threading

import pytest
import ray
import torch

from gspo_ray.config import load_config
from gspo_ray.coordinator.loop import Coordinator, LoopState
from gspo_ray.coordinator.pools import ColocatedPlacement, build_rollout_pool
from gspo_ray.rollout.worker import RolloutWorker

COLOCATED = ["rollout.num_gpus_per_worker=0.5", "trainer.num_gpus_per_worker=0.5", "trainer.num_workers=4",
             "trainer.tp=2", "rollout.num_workers=2", "rollout.tensor_parallel_size=2", "rollout.verify_push=false",
             "rollout.weight_transfer=object_store"]


@pytest.fixture(scope="module")
def gpu_ray():
    if ray.is_initialized():  # the package's shared instance has no GPUs: the next module that asks starts it again
        ray.shutdown()
    ray.init(num_cpus=6, num_gpus=4, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the stand-ins travel to the actors
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def placed(gpu_ray, tmp_path_factory):
    """(config, placement, rollout pool of two TP 2 stand-in engines), once for the module: each actor start
    imports the worker's modules (seconds on 2 cores)."""
    cfg = load_config(None, COLOCATED)
    placement = ColocatedPlacement(cfg, timeout_s=60)
    run_dir = tmp_path_factory.mktemp("colocated")
    pool = build_rollout_pool(cfg, run_dir, run_dir, placement=placement, worker_cls=CudaEngineStandIn)
    yield cfg, placement, pool
    pool.shutdown()
    placement.remove()


class _RecordingLLM:
    """vLLM's `LLM` sleep / wake_up, recorded."""

    def __init__(self, log):
        self.log = log

    def sleep(self, level=1, mode="abort"):
        self.log.append(("sleep", level, mode))

    def wake_up(self, tags=None):
        self.log.append(("wake_up", tuple(tags)))


class _RecordingEngine:
    def __init__(self, sleep_mode):
        self.log, self.sleeps = [], sleep_mode
        self.llm = _RecordingLLM(self.log)

    def load_weights(self, pairs):
        self.log.append(("load_weights", len(list(pairs))))
        return {}


class CudaEngineStandIn(RolloutWorker):
    """A rollout worker whose engine stands in for a CUDA vLLM engine started with sleep mode; the worker's own
    sleep / wake / push code runs as is."""

    def __init__(self, worker_id, model_path, cfg=None, run_dir="", reward_runner=None, sleep_mode=False):
        self.worker_id, self.cfg, self.model_path, self.reward_runner = worker_id, cfg, model_path, None
        self.engine = _RecordingEngine(sleep_mode)
        self._version, self._lock, self._paused = 0, threading.Lock(), threading.Event()
        self._broken, self._metrics, self._asleep = None, {}, set()

    def where(self):
        return ray.get_runtime_context().get_node_id(), ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")

    def calls(self):
        return list(self.engine.log)


@ray.remote
class RankStandIn:
    def where(self):
        return ray.get_runtime_context().get_node_id(), [str(i) for i in ray.get_gpu_ids()]


def test_engines_sit_on_their_ranks_gpus_and_ask_for_none(placed):
    cfg, placement, pool = placed
    ranks = [RankStandIn.options(num_cpus=cfg.trainer.num_cpus_per_worker, num_gpus=0.5,
                                 scheduling_strategy=placement.rank_strategy(r)).remote() for r in range(4)]
    rank_at = ray.get([r.where.remote() for r in ranks])
    assert sorted(g for _, gpus in rank_at for g in gpus) == ["0", "1", "2", "3"]  # one GPU per rank
    engines = [ray.get(pool.workers[i].where.remote()) for i in sorted(pool.workers)]
    for i, (node, own_gpus, visible) in enumerate(engines):
        assert own_gpus == []  # no GPU of its own from Ray
        mine = rank_at[2 * i:2 * i + 2]  # engine i spans ranks 2i, 2i+1
        assert visible == ",".join(gpus[0] for _, gpus in mine) and {n for n, _ in mine} == {node}
    assert placement.check_transport("auto") == "ipc"  # chosen from where Ray put them
    with pytest.raises(RuntimeError, match="cannot grow"):  # every GPU holds a live engine
        pool.scale(3)
    for r in ranks:
        ray.kill(r)


class _Trainer:
    """The trainer pool's calls of a step, recording into the step's log."""

    def __init__(self, log):
        self.log = log

    def export_weights(self, bucket_mb=None, as_refs=False, shared=False):
        class Export:
            shared, buckets = None, [[("w", torch.zeros(2))]]
        self.log.append("export")
        return Export()


def test_colocated_engines_sleep_through_the_train_phase_in_verls_order(placed, monkeypatch):
    cfg, _, pool = placed
    log = []
    coord = Coordinator(cfg, pool, _Trainer(log), None, LoopState())
    monkeypatch.setattr(coord, "collect_groups", lambda: (log.append("generate") or [], {}))
    monkeypatch.setattr(coord, "train_on", lambda groups: (log.append("train") or {}))
    m = coord.step()
    for wid in sorted(pool.workers):
        assert ray.get(pool.workers[wid].calls.remote()) == [
            ("sleep", 1, "wait"),  # "wait": in-flight requests finish (vLLM's default "abort" drops them)
            ("wake_up", ("weights",)), ("load_weights", 1), ("wake_up", ("kv_cache",))]
    assert log == ["generate", "train", "export"] and m["sync/engines_asleep"] == 2
