"""rollout.weight_transfer in the job: resolved once (a pure function), said in the engines line, and the coordinator's
dispatch of an nccl / ipc push (coordinator/transfer_push.py): which calls, in which order, every engine at once.

vLLM's nccl / ipc engines need CUDA on both sides, which this machine does not have, so the dispatch test runs the
real `RolloutPool`, `ActorPoolClient` and `TransferPush` over Ray actors that stand in for what cannot exist here:
`RecordingEngine` (a rollout actor's two transfer verbs, recording each call; every phase waits at a barrier until
all engines have entered it, so calls sent one engine after the other would time out) and `SenderStandIn` (the
trainer pool; its rank 0 calls the client in the order vLLM's `NCCLTrainerWeightTransferEngine` does:
`init_weight_transfer_engine` with vLLM's own worker payload when started, then start / update / finish per push).
`RecordingEngine.generate` records the call and stamps its samples with the engine's published version, so a test
can tell an engine that served before it had the live policy.
"""
from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import pytest
import ray

from gspo_ray.config import load_config
from gspo_ray.coordinator.loop import Coordinator, LoopState
from gspo_ray.coordinator.pools import rollout_config
from gspo_ray.coordinator.rollout_pool import RolloutPool
from gspo_ray.coordinator.transfer_push import TransferPush
from gspo_ray.data.records import Prompt, Sample
from gspo_ray.rollout.engine_env import describe_engines
from gspo_ray.rollout.weight_transfer import EngineTransferError, resolve_weight_transfer
from gspo_ray.trainer.pool import TrainerPool, TrainerRankDied, TrainerRankFailed

# `stand_in_send` runs in the rank actors: by value, since pytest imports this module under a name they cannot
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.mark.parametrize("requested,rollout_gpus,trainer_gpus,lora_serve,expected", [
    ("auto", 0, 0, None, "shm"),              # CPU: gspo_shm, the file or refs per push as before (export_plan)
    ("auto", 1, 0, None, "shm"),              # a CPU trainer: host memory either way
    ("auto", 0, 1, None, "shm"),
    ("auto", 1, 1, None, "nccl"),             # whole GPUs never share: broadcast
    ("auto", 0.5, 1, None, "nccl"),
    ("auto", 0.5, 0.5, None, "ipc"),          # both fractional: Ray packs them onto one GPU
    ("object_store", 0, 0, None, "object_store"),
    ("nccl", 0.5, 0.5, None, "nccl"),         # an explicit value is kept
    # trainer.lora.serve merged: full weights W + scale B A, from the trainer's merged view like full fine-tuning
    ("auto", 1, 1, "merged", "nccl"),
    ("auto", 0.5, 0.5, "merged", "ipc"),
    ("auto", 0, 0, "merged", "shm"),
    ("ipc", 0.5, 0.5, "merged", "ipc"),
    ("auto", 1, 1, "adapter", "shm"),         # the adapter goes through vLLM's LoRA API: the trainer's export
    ("object_store", 1, 1, "adapter", "object_store"),
])
def test_resolve_weight_transfer(requested, rollout_gpus, trainer_gpus, lora_serve, expected):
    assert resolve_weight_transfer(requested, rollout_gpus=rollout_gpus, trainer_gpus=trainer_gpus,
                                   lora_serve=lora_serve) == expected


def test_lora_pushes_stay_on_the_trainers_export():
    """Only adapter pushes (trainer.lora.serve adapter): nccl / ipc send full weights, refused in one line naming
    the field; merged pushes resolve like full fine-tuning, down to the workers' config."""
    for transport in ("nccl", "ipc"):
        with pytest.raises(ValueError, match=rf"^rollout.weight_transfer '{transport}' sends full weights; "
                                             r"trainer.lora.serve adapter pushes the adapter through vLLM's LoRA API"):
            resolve_weight_transfer(transport, rollout_gpus=0.5, trainer_gpus=0.5, lora_serve="adapter")
    gpus = ["rollout.num_gpus_per_worker=0.5", "trainer.num_gpus_per_worker=0.5"]
    assert rollout_config(load_config(None, gpus + ["trainer.lora.serve=adapter"])).weight_transfer == "shm"
    assert rollout_config(load_config(None, gpus + ["trainer.lora.serve=merged"])).weight_transfer == "ipc"


def test_resolution_reaches_the_workers_and_the_engines_line():
    assert rollout_config(load_config(None, [])).weight_transfer == "shm"
    cfg = load_config(None, ["rollout.num_gpus_per_worker=0.5", "trainer.num_gpus_per_worker=0.5"])
    assert rollout_config(cfg).weight_transfer == "ipc"
    with pytest.raises(ValueError, match="rollout.weight_transfer 'ipc' moves CUDA tensors"):
        resolve_weight_transfer("ipc", rollout_gpus=0, trainer_gpus=1)
    assert describe_engines(1, False, False, "shm").endswith(
        "gspo_shm: the shared-memory file on trainer rank 0's node, the object store elsewhere "
        "(rollout.weight_transfer shm)")
    assert "vLLM's nccl backend, sent from the trainer's shards" in describe_engines(2, False, True, "nccl")


@ray.remote(num_cpus=0)
class Barrier:
    def __init__(self):
        self.expected, self.seen = 0, {}

    def reset(self, expected: int) -> None:
        self.expected, self.seen = expected, {}

    def arrive(self, method: str) -> None:
        self.seen[method] = self.seen.get(method, 0) + 1

    def all_in(self, method: str) -> bool:
        return self.seen.get(method, 0) >= self.expected


@ray.remote(num_cpus=0)
class RecordingEngine:
    """Stands in for a RolloutWorker whose engine runs vLLM's nccl backend (CUDA only)."""

    def __init__(self, worker_id: int, barrier, barrier_s: float = 10):
        self.worker_id, self.barrier, self.calls, self.version = worker_id, barrier, [], 0
        self.die_in, self.barrier_s = None, barrier_s

    def ping(self) -> int:
        return self.worker_id

    def die_in_phase(self, method: str) -> None:
        """Its process exits (as at a kill -9) once it has entered `method` (the others go on past the barrier)."""
        self.die_in = method

    def weight_transfer_call(self, method: str, request=None) -> None:
        self.calls.append((method, request))
        ray.get(self.barrier.arrive.remote(method))
        if method == self.die_in:
            os._exit(1)
        if method == "shutdown_weight_transfer_engine":  # each engine's own release, no rendezvous
            return
        deadline = time.monotonic() + self.barrier_s
        while not ray.get(self.barrier.all_in.remote(method)):  # an NCCL rendezvous: everyone or nobody
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.worker_id}: not every engine entered {method}")
            time.sleep(0.01)

    def publish_weights(self, version: int, probe=None) -> dict[str, float]:
        self.calls.append(("publish_weights", (version, probe)))
        self.version = version
        return {"sync/verify_max_abs_diff": 0.001 * (self.worker_id + 1)}

    def generate(self, prompts, n, budget=None, **sampling) -> list[Sample]:
        self.calls.append(("generate", [p.uid for p in prompts]))
        return [Sample(prompt_uid=p.uid, sample_index=i, prompt_ids=[1], completion_ids=[2], logprobs=[0.0],
                       loss_mask=[1], versions=[self.version], finish_reason="stop", worker_id=self.worker_id)
                for p in prompts for i in range(n)]

    def recorded(self) -> list:
        return self.calls

    def shutdown(self) -> None:
        pass


@ray.remote(num_cpus=0)
class RankStandIn:
    """Stands in for a TrainerWorker (Megatron on CUDA): what `stand_in_send` keeps on it between pushes."""

    def __init__(self, rank: int):
        self.rank, self.key, self.stall = rank, None, 0.0

    def stall_in_gathers(self, seconds: float) -> None:
        """A rank other than 0 then takes this long in each push (as in the bucket gathers with trainer TP > 1)."""
        self.stall = seconds

    def version(self) -> int:
        return 0

    def forget(self) -> None:
        self.key = None

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def ranks(local_ray):
    """One pair of trainer rank stand-ins for the module (each test's `SenderStandIn` makes them forget their
    sender); killed at the end."""
    handles = [RankStandIn.remote(r) for r in range(2)]
    yield handles
    for h in handles:
        ray.kill(h)


def stand_in_send(rank, key, payload, client, timeout_s=None) -> None:
    """trainer/weights/weight_send.send_on_rank's part on one rank (in its actor, through `__ray_call__`): rank 0 drives
    the client as vLLM's NCCL trainer engine does (`payload`: vLLM's worker init payload, built by the caller), the
    others only join the gathers (none here)."""
    if rank.rank != 0:
        time.sleep(rank.stall)
        return
    if key != rank.key:  # trainer_init: vLLM's worker payload, rank_offset 1 after the single sender
        client.init_weight_transfer_engine(payload)
        rank.key = key
    client.start_weight_update()
    client.update_weights(update_info(["w"]))
    client.finish_weight_update()


class SenderStandIn(TrainerPool):
    """Stands in for the trainer pool: two rank actors (`RankStandIn`), called through the real TrainerPool's
    `call_ranks` as `send_by_transfer` does (so an error on rank 0 is classified by the real pool code)."""

    def __init__(self, barrier, ranks):
        self.barrier, self.pg, self.workers = barrier, None, list(ranks)
        ray.get([r.forget.remote() for r in ranks])
        self.sent, self.held = [], 0  # held: the policy version the ranks hold

    def version(self) -> int:
        return self.held

    def rank0_address(self):
        return "10.0.0.1", 29611

    send = staticmethod(stand_in_send)  # what each rank runs

    def send_by_transfer(self, key, init_infos, client, timeout_s=None) -> None:
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

        self.sent.append((key, init_infos))
        ray.get(self.barrier.reset.remote(len(key[1])))
        info = init_infos[0]  # vLLM's worker payload as its trainer_init builds it (built here: no vLLM import there)
        payload = worker_init_payload(NCCLWeightTransferInitInfo(
            master_address=info.master_address, master_port=info.master_port, rank_offset=1,
            world_size=info.world_size, packed=info.packed, packed_buffer_size_bytes=info.packed_buffer_size_bytes,
            packed_num_buffers=info.packed_num_buffers))
        self.call_ranks(self.send, key, payload, client, timeout_s)


def update_info(names):
    return {"names": names, "dtype_names": ["float32"] * len(names), "shapes": [[2, 2]] * len(names)}


def test_nccl_push_calls_every_engine_at_once_in_vllms_order(ranks):
    barrier = Barrier.remote()
    pool = RolloutPool(lambda wid: RecordingEngine.remote(wid, barrier), 2)
    trainer = SenderStandIn(barrier, ranks)
    push = TransferPush("nccl", tensor_parallel_size=2, bucket_bytes=2**20)
    m1 = push(pool, trainer, version=3, probe=None)
    m2 = push(pool, trainer, version=4, probe=None)
    assert m1["sync/verify_max_abs_diff"] == pytest.approx(0.002)  # the worst engine's check
    assert m2["sync/transfer_s"] <= m2["sync/push_s"]

    (key1, infos), (key2, infos2) = trainer.sent
    assert key1 == key2 == ("nccl", (0, 1)) and infos2 is infos  # one rendezvous while the engines stay
    assert [i.rank for i in infos] == [0, 1] and {i.world_size for i in infos} == {5}  # 1 trainer + 2 x TP 2
    assert {(i.master_address, i.master_port, i.packed_buffer_size_bytes) for i in infos} == {
        ("10.0.0.1", 29611, 2**20)}
    calls = ray.get([h.recorded.remote() for h in pool.workers.values()])
    for wid, engine_calls in enumerate(calls):
        methods = [c[0] for c in engine_calls]
        assert methods == ["shutdown_weight_transfer_engine",  # a rendezvous releases the last one's group first
                           "init_weight_transfer_engine", "start_weight_update", "update_weights",
                           "finish_weight_update", "publish_weights",
                           "start_weight_update", "update_weights", "finish_weight_update", "publish_weights"]
        init = engine_calls[1][1]["init_info"]
        assert init["rank_offset"] == 1 + 2 * wid and init["world_size"] == 5  # engine 1 after engine 0's 2
        assert engine_calls[3][1] == {"update_info": update_info(["w"])}
        assert engine_calls[5][1] == (3, None) and engine_calls[9][1] == (4, None)

    pool.scale(1)  # a new engine set (worker 1 stopped): a new rendezvous, engine 0 alone in a world of 3
    push(pool, trainer, version=5, probe=None)
    key3, infos3 = trainer.sent[-1]
    assert key3 == ("nccl", (0,)) and {i.world_size for i in infos3} == {3}
    last = ray.get(pool.workers[0].recorded.remote())[-6:]
    assert [c[0] for c in last] == ["shutdown_weight_transfer_engine", "init_weight_transfer_engine",
                                    "start_weight_update", "update_weights", "finish_weight_update",
                                    "publish_weights"]
    assert last[1][1]["init_info"]["rank_offset"] == 1 and last[1][1]["init_info"]["world_size"] == 3
    pool.shutdown()


def test_ipc_records_and_a_non_cuda_transport_refused():
    push = TransferPush("ipc", tensor_parallel_size=1, bucket_bytes=2**20)
    infos = push.init_records(SimpleNamespace(num_workers=2), [1])
    assert [i.rank for i in infos] == [0, 1] and all(i.backend == "ipc" for i in infos)
    with pytest.raises(ValueError, match="nccl / ipc"):
        TransferPush("shm", tensor_parallel_size=1, bucket_bytes=1)


def kill(handle) -> None:
    """ray.kill, then until the actor is gone (the kill is asynchronous: a call sent right after may still run)."""
    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(handle.ping.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.01)
    raise AssertionError("the killed actor still answers")


PHASES = ["shutdown_weight_transfer_engine", "init_weight_transfer_engine", "start_weight_update", "update_weights",
          "finish_weight_update", "publish_weights"]


def test_new_and_replacement_engines_get_the_live_policy_before_serving(ranks):
    """A job whose pushes go through nccl (the coordinator's wiring): engines added by `scale` and a replacement
    for a dead one get the trainer's transfer (a rendezvous of their own) and the live version before they join
    the pool or serve; before the first push they get nothing (they serve the checkpoint, version 0)."""
    barrier, made = Barrier.remote(), {}
    pool = RolloutPool(lambda wid: made.setdefault(wid, RecordingEngine.remote(wid, barrier)), 0)
    trainer = SenderStandIn(barrier, ranks)
    cfg = load_config(None, ["rollout.num_gpus_per_worker=1", "trainer.num_gpus_per_worker=1",
                             "rollout.tensor_parallel_size=2"])
    coord = Coordinator(cfg, pool, trainer, None, LoopState())
    assert coord.transport == "nccl"
    hook, members = pool.on_new_workers, []
    pool.on_new_workers = lambda new: (members.append((sorted(new), sorted(pool.workers))), hook(new))

    pool.scale(2)  # before any push: nothing sent, the engines serve the checkpoint (engines 0, 1 start together)
    assert members == [([0, 1], [])] and trainer.sent == []

    coord.state.version = trainer.held = 7
    coord.sync_weights()
    assert trainer.sent[-1][0] == ("nccl", (0, 1))
    assert [c[0] for c in ray.get(pool.workers[1].recorded.remote())] == PHASES  # the push, nothing before it
    pool.scale(4)  # engines 2, 3 alone: trainer rank 0 + their 2 x 2 workers, the live version, then they join
    assert members[-1] == ([2, 3], [0, 1]) and sorted(pool.workers) == [0, 1, 2, 3]
    assert trainer.sent[-1][0] == ("nccl", (2, 3)) and {i.world_size for i in trainer.sent[-1][1]} == {5}
    for wid, offset in ((2, 1), (3, 3)):  # ranks within the subset's world, not the pool's
        calls = ray.get(pool.workers[wid].recorded.remote())
        assert [c[0] for c in calls] == PHASES and calls[-1][1] == (7, None)
        assert calls[1][1]["init_info"]["rank_offset"] == offset and calls[1][1]["init_info"]["world_size"] == 5
    assert [c[0] for c in ray.get(pool.workers[0].recorded.remote())] == PHASES  # the others: untouched

    coord.state.version = trainer.held = 8
    coord.sync_weights()  # the next push: every engine again, in a new rendezvous (world 1 + 4 x 2)
    assert trainer.sent[-1][0] == ("nccl", (0, 1, 2, 3))
    for wid in range(4):
        init = [c for c in ray.get(pool.workers[wid].recorded.remote()) if c[0] == PHASES[1]][-1][1]["init_info"]
        assert init["rank_offset"] == 1 + 2 * wid and init["world_size"] == 9

    pool.scale(1)
    kill(pool.workers[0])  # the last engine dies: its batch goes to a replacement (4)
    groups, _ = pool.generate([Prompt(uid="p0", prompt_ids=[1])], n=2)
    assert members[-1] == ([4], []) and sorted(pool.workers) == [4] and pool.restarts_left == 2
    calls = ray.get(pool.workers[4].recorded.remote())
    assert [c[0] for c in calls] == PHASES + ["generate"] and calls[5][1] == (8, None)
    assert [s.versions for s in groups[0].samples] == [[8], [8]]  # sampled with the live policy, not the base
    assert trainer.sent[-1][0] == ("nccl", (4,))

    kill(pool.workers[4])  # a batch whose engine died, discarded (a trainer recovery): the
    pool.discard(pool.submit([Prompt(uid="p1", prompt_ids=[1])], n=2))  # pool is empty at the recovery's push
    assert pool.workers == {}
    coord.state.version = trainer.held = 9
    coord.sync_weights()  # no engine to send to: the pool's replacement (5) gets this push before it joins
    assert members[-1] == ([5], []) and sorted(pool.workers) == [5] and trainer.sent[-1][0] == ("nccl", (5,))
    assert [c[0] for c in ray.get(pool.workers[5].recorded.remote())] == PHASES and pool.restarts_left == 1

    trainer.held, sent = 0, len(trainer.sent)  # the trainer rebuilt and not reloaded yet (a recovery under way)
    with pytest.raises(RuntimeError, match=r"rollout worker\(s\) \[6\]: the trainer holds policy version 0") as e:
        pool.scale(2)
    assert e.value.__notes__ == ["rollout worker(s) [6] did not receive the live policy: stopped before serving"]
    assert sorted(pool.workers) == [5] and len(trainer.sent) == sent  # nothing sent; engine 6 never joins ...
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(made[6].ping.remote(), timeout=30)  # ... and was stopped
    pool.shutdown()


def test_an_engine_lost_before_or_during_a_push_is_the_rollouts_fault(ranks, monkeypatch):
    """An engine dead before a push is dropped before the rendezvous (its ping fails); one that dies inside a phase
    (the trainer's sender running in rank 0's actor) fails that phase with EngineTransferError, not a Ray actor
    error: the trainer pool keeps its ranks, the coordinator drops the dead engine and pushes again to the others
    in a new rendezvous. Every serving engine then holds the pushed version; the trainer is not recovered. Only
    where the other trainer ranks were left waiting on rank 0 (killed by the pool) is it the trainer's death."""
    barrier = Barrier.remote()
    pool = RolloutPool(lambda wid: RecordingEngine.remote(wid, barrier), 3)
    trainer = SenderStandIn(barrier, ranks)
    push = TransferPush("nccl", tensor_parallel_size=1, bucket_bytes=2**20)
    push(pool, trainer, version=1)

    kill(pool.workers[2])  # between two pushes: out before the trainer starts sending
    m = push(pool, trainer, version=2)
    assert sorted(pool.workers) == [0, 1] and m["sync/engines_dropped"] == 1 and push.faults == []
    assert trainer.sent[-1][0] == ("nccl", (0, 1))

    ray.get(pool.workers[1].die_in_phase.remote("start_weight_update"))  # dies inside the push's first phase
    m = push(pool, trainer, version=3)
    assert sorted(pool.workers) == [0] and m["sync/engines_dropped"] == 1
    (error,) = push.faults
    assert isinstance(error, TrainerRankFailed) and not error.killed and error.rank == 0
    assert isinstance(error.cause, EngineTransferError) and error.cause.dead == [1]
    assert not isinstance(error, ray.exceptions.RayActorError)
    assert not isinstance(error.cause, ray.exceptions.RayActorError)
    assert [k for k, _ in trainer.sent[-2:]] == [("nccl", (0, 1)), ("nccl", (0,))]  # again, a new rendezvous
    calls = ray.get(pool.workers[0].recorded.remote())
    assert [c[0] for c in calls[-7:]] == ["start_weight_update"] + PHASES  # the failed phase, then the retry
    assert calls[-5][1]["init_info"]["world_size"] == 2 and calls[-1][1] == (3, None)
    assert trainer.workers == ranks and ray.get([r.version.remote() for r in ranks]) == [0, 0]  # not recovered

    # with trainer TP / EP > 1 the other ranks sit in the bucket gathers while rank 0 sends (here rank 1 stalls
    # past ERROR_GRACE_S): the pool kills its ranks, and the push raises TrainerRankDied, the job's trainer recovery
    monkeypatch.setattr("gspo_ray.trainer.pool.ERROR_GRACE_S", 0.2)
    stuck = SenderStandIn(barrier, [RankStandIn.remote(r) for r in range(2)])
    ray.get([stuck.workers[1].stall_in_gathers.remote(30), pool.workers[0].die_in_phase.remote("update_weights")])
    with pytest.raises(TrainerRankDied, match="trainer rank 0 died during __ray_call__") as e:
        push(pool, stuck, version=4)
    assert isinstance(e.value.__cause__, TrainerRankFailed) and e.value.__cause__.killed
    assert e.value.__notes__ == ["rollout engine(s) [0] failed the push (update_weights); the other trainer ranks "
                                 "were stuck in its gathers and were killed"]
    assert pool.workers == {} and len(stuck.sent) == 1  # no retry (no trainer to send from), no replacement yet
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(stuck.workers[1].version.remote(), timeout=30)



class AbortableBroadcast:
    """Stands in for vLLM's `NCCLTrainerWeightTransferEngine` on rank 0 (CUDA only): its rendezvous calls the
    client's init; `send_weights` runs the engines' update_weights on a side thread while it "broadcasts", which
    blocks until every engine received (here: until the side thread ends) or the sender is shut down
    (ncclCommAbort), then raises as NCCL would; `shutdown` counted."""

    def __init__(self, client, payload):
        import threading

        self.client, self.aborted, self.shutdowns = client, threading.Event(), 0
        client.init_weight_transfer_engine(payload)

    def send_weights(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.client.start_weight_update()
        exe = ThreadPoolExecutor(max_workers=1)
        future = exe.submit(self.client.update_weights, update_info(["w"]))
        while not future.done():  # a broadcast with a dead peer never ends on its own
            if self.aborted.wait(0.02):
                exe.shutdown(wait=False)
                raise RuntimeError("NCCL error: communicator aborted")
        future.result()
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.aborted.set()


def watched_send(rank, key, payload, client, timeout_s=None) -> None:
    """trainer/weights/weight_send.send_on_rank's part on one rank, through the real TransferSender and its watchdog,
    with `AbortableBroadcast` as vLLM's sender on rank 0."""
    from gspo_ray.trainer.weights.weight_send import TransferSender

    if rank.rank != 0:
        return
    previous, rank.sender = getattr(rank, "sender", None), None
    rank.sender = TransferSender.push(previous, key, lambda: AbortableBroadcast(client, payload), is_sender=True,
                                      timeout_s=timeout_s)


class WatchedSenderStandIn(SenderStandIn):
    send = staticmethod(watched_send)


def test_an_engine_killed_inside_the_broadcast_ends_the_push_within_its_bound(ranks):
    """Rank 0 blocked in the broadcast while an engine actor is killed: the watchdog aborts the broadcast as soon
    as the client sees the death (not at the bound, not never), the dead engine is dropped, the push goes again to
    the survivor, and the job goes on: the trainer's ranks kept, the pool serving the pushed version."""
    barrier = Barrier.remote()
    pool = RolloutPool(lambda wid: RecordingEngine.remote(wid, barrier, barrier_s=2), 2)
    trainer = WatchedSenderStandIn(barrier, ranks)
    push = TransferPush("nccl", tensor_parallel_size=1, bucket_bytes=2**20, push_timeout_s=60)
    push(pool, trainer, version=1)
    ray.get(pool.workers[1].die_in_phase.remote("update_weights"))
    t0 = time.monotonic()
    m = push(pool, trainer, version=2)
    assert time.monotonic() - t0 < 30  # far inside the 60 s bound: the death, not the bound, ended it
    assert sorted(pool.workers) == [0] and m["sync/engines_dropped"] == 1
    (error,) = push.faults
    assert isinstance(error, TrainerRankFailed) and not error.killed
    assert isinstance(error.cause, EngineTransferError) and error.cause.dead == [1]
    assert [k for k, _ in trainer.sent[-2:]] == [("nccl", (0, 1)), ("nccl", (0,))]
    assert ray.get(pool.workers[0].recorded.remote())[-1] == ("publish_weights", (2, None))
    assert trainer.workers == ranks and ray.get([r.version.remote() for r in ranks]) == [0, 0]  # not recovered
    pool.shutdown()


def test_ipc_pushes_are_packed():
    """vLLM's ipc sender with `packed=True` and the job's bucket bytes: one reusable buffer, not the whole model
    shared until `finish`."""
    push = TransferPush("ipc", tensor_parallel_size=1, bucket_bytes=3 * 2**20)
    infos = push.init_records(SimpleNamespace(num_workers=2), [1])
    assert {(i.packed, i.packed_buffer_size_bytes) for i in infos} == {(True, 3 * 2**20)}
