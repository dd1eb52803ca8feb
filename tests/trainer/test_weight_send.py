"""The trainer side of nccl / ipc pushes without CUDA: which vLLM sender a push uses and when it is shut down,
rank 0's watchdog over a broadcast that never returns, the rendezvous port, and (two gloo ranks, Megatron's TP
groups) the other ranks waiting for rank 0's start before their bucket gathers.

vLLM's senders need CUDA (NCCL, CUDA IPC); `StandInSender` stands in for one: `send_weights` calls its client in
vLLM's nccl order (start, then the source iterated as the broadcast, then finish) and `shutdown` is counted.
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from _spawn import run_ranks
from gspo_ray.trainer.pool import rendezvous_address
from gspo_ray.trainer.push_guard import PushTimeout, send_bounded
from gspo_ray.trainer.weights.weight_send import TransferSender, send_on_rank


class StandInSender:
    """vLLM's trainer-side engine as far as a push sees it (its NCCL group: `shutdown` counted)."""

    def __init__(self, client=None, source=(), block: threading.Event | None = None):
        self.client, self.source, self.block, self.shutdowns, self.sends = client, source, block, 0, 0

    def send_weights(self) -> None:
        self.sends += 1
        if self.client is not None:
            self.client.start_weight_update()
        for _ in self.source:  # the broadcast: iterating the source runs the bucket gathers
            pass
        if self.block is not None and not self.block.wait(30):  # a broadcast whose peer died: until aborted
            raise AssertionError("never aborted")
        if self.client is not None:
            self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.shutdowns += 1
        if self.block is not None:
            self.block.set()  # ncclCommAbort ends the pending broadcast


def test_a_replaced_or_failed_sender_is_shut_down():
    first = StandInSender()
    kept = TransferSender.push(None, ("nccl", (0, 1)), lambda: first, is_sender=False)
    assert TransferSender.push(kept, ("nccl", (0, 1)), lambda: StandInSender(), is_sender=False) is kept
    assert first.sends == 2 and first.shutdowns == 0  # the same engines: the same sender, no new rendezvous

    second = StandInSender()
    replaced = TransferSender.push(kept, ("nccl", (0,)), lambda: second, is_sender=False)
    assert replaced.sender is second and first.shutdowns == 1  # a new rendezvous: the old group released

    broken = StandInSender()
    broken.send_weights = lambda: (_ for _ in ()).throw(RuntimeError("NCCL error"))
    with pytest.raises(RuntimeError, match="NCCL error"):
        TransferSender.push(None, ("nccl", (0,)), lambda: broken, is_sender=False)
    assert broken.shutdowns == 1  # unusable after a failed broadcast: shut down, never kept


def test_rank0_watchdog_aborts_a_broadcast_whose_engine_failed():
    """The engines' side fails (seen by the client) while the broadcast blocks: aborted at once, the engine's
    error raised; with no fault, the bound does it."""
    block, client = threading.Event(), SimpleNamespace(fault=None, start_weight_update=lambda: None)
    sender = StandInSender(client, block=block)
    threading.Timer(0.3, lambda: setattr(client, "fault", RuntimeError("engine 1 dead"))).start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="engine 1 dead"):
        send_bounded(sender.send_weights, lambda: client.fault, sender.shutdown, timeout_s=30)
    assert time.monotonic() - t0 < 5 and sender.shutdowns == 1

    sender = StandInSender(SimpleNamespace(start_weight_update=lambda: None), block=threading.Event())
    with pytest.raises(PushTimeout, match=r"rollout.push_timeout_s \(0.2 s\)"):
        send_bounded(sender.send_weights, lambda: None, sender.shutdown, timeout_s=0.2, slack_s=0)
    assert sender.shutdowns == 1


def test_rendezvous_port_is_below_the_ephemeral_range():
    """bind(0) hands out an ephemeral port, which the kernel gives to the next outgoing connection too."""
    ephemeral_low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {rendezvous_address(None)[1] for _ in range(5)}
    assert all(20000 <= p < ephemeral_low for p in ports)


class DelayedStartClient:
    """Engines still generating (async mode): they accept start_weight_update only after `delay_s`."""

    def __init__(self, delay_s: float):
        self.delay_s, self.fault, self.calls = delay_s, None, []

    def start_weight_update(self) -> None:
        time.sleep(self.delay_s)
        self.calls.append("start_weight_update")

    def finish_weight_update(self) -> None:
        self.calls.append("finish_weight_update")


def delayed_start_scenario(rank, world_size, ports, delay_s, collective_timeout_s):
    """Two gloo ranks at TP 2 (Megatron's groups, `collective_timeout_s` on every collective); rank 0's stand-in
    sender waits `delay_s` for the engines' start before iterating the source; each rank's source is the real
    MegatronWeightSource over a TP-sharded embedding (one bucket gather)."""
    from gspo_ray.trainer.model_spec import ModelSpec
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed

    init_distributed(rank, world_size, "127.0.0.1", ports[0], tp=2, backend="gloo", timeout_s=collective_timeout_s)
    try:
        spec = ModelSpec(arch="llama", hf_config={}, hf_dir="", vocab_size=16, padded_vocab_size=16, num_layers=1,
                         hidden_size=8, num_heads=2, num_kv_heads=2, head_dim=4, ffn_hidden_size=16, tp=2)
        shard = torch.full((8, 8), float(rank))
        worker = SimpleNamespace(rank=rank, spec=spec, lora=None, gpt={"embedding.word_embeddings.weight": shard},
                                 cfg=SimpleNamespace(export_bucket_mb=1))
        client = DelayedStartClient(delay_s)
        start = lambda info, client, source: StandInSender(client if rank == 0 else None, source)  # noqa: E731
        info = SimpleNamespace(backend="nccl")
        send_on_rank(worker, ("nccl", (0,)), [info, info], client, 60.0, start)
        return client.calls
    finally:
        destroy_distributed()


def test_other_ranks_wait_for_rank0s_start_before_their_gathers():
    """The engines take 4 s to accept the push's start, the collective timeout is 2 s: rank 1 waits at the gate
    (bounded by the push's bound), not in the bucket's TP gather."""
    calls = run_ranks(delayed_start_scenario, world_size=2, args=(4.0, 2.0), timeout_s=120)
    assert calls[0] == ["start_weight_update", "finish_weight_update"] and calls[1] == []
