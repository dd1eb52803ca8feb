"""Full-weight pushes on CPU through vLLM's weight-transfer protocol: a backend of ours, `gspo_shm`.

    LLM(..., weight_transfer_config={"backend": BACKEND}, worker_extension_cls=EXTENSION)  # engine_kwargs()
    llm.init_weight_transfer_engine({"init_info": {}})          # once, after start-up
    llm.start_weight_update()                                   # every vLLM worker: layer-wise reload begins
    llm.update_weights({"update_info": update_info(shared)})    # each worker maps the file, loads its shard
    llm.finish_weight_update()                                  # layers re-processed, the CPU re-pack fixes
    llm.collective_rpc("gspo_push_report")                      # one report per worker (fixes applied)

vLLM 0.32 (`vllm/distributed/weight_transfer/`) runs the same four phases on every worker of an engine, CPU workers
included, for its own backends (`nccl`, `ipc`: CUDA only). This one carries the shared-memory export we already
have (`data/shared_weights.py`): `update_info` is the export's small record (names, dtypes, shapes, offsets, the
writer's pid and fd), every worker (the TP ranks of a multi-process engine are separate processes) maps the file
itself and feeds the whole model through the model's own `load_weights`, whose weight loaders keep only the rank's
shard (column / row slices, its experts under expert parallelism). Phases 2 and 4 are vLLM's layer-wise reload,
the same calls `reload_weights` makes, so a push into a TP 1 engine behaves as before.

In-process engines (TP 1 on CPU: one worker, in the caller's process) may pass `local=<iterator of (name, tensor)>`
instead of a record: the pairs are read straight from the iterator (an object-store push, a checkpoint reset) with
no copy into a file. A multi-process engine never gets `local` (tensors must not cross vLLM's RPC: FACTS.md).

Registration: vLLM creates the backend inside each worker process at model load, from the registry of that
process. `worker_extension_cls=EXTENSION` makes every worker import this module (vLLM resolves the class before
loading the model), and importing it registers the backend; the extension adds `gspo_push_report`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from gspo_ray.compat.vllm_cpu_mla_rope import apply_mla_rope_fix
from gspo_ray.compat.vllm_cpu_seeded_prefill import apply_seeded_prefill_fix
from gspo_ray.data.shared_weights import SharedWeights, read_shared

BACKEND = "gspo_shm"
EXTENSION = "gspo_ray.rollout.shm_transfer.PushReportExtension"


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the file is named by each update."""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """One export's record (`SharedWeights` without its fallback), or `local` pairs for an in-process engine."""

    node_id: str = ""
    pid: int = 0
    fd: int = -1
    token: str = ""  # hex of the writer's token
    generation: int = 0
    nbytes: int = 0
    entries: list = field(default_factory=list)
    local: Any = None

    def record(self) -> SharedWeights:
        return SharedWeights(node_id=self.node_id, pid=self.pid, fd=self.fd, token=bytes.fromhex(self.token),
                             generation=self.generation, nbytes=self.nbytes,
                             entries=[(n, d, tuple(s), o) for n, d, s, o in self.entries])


def update_info(shared: SharedWeights) -> dict:
    """The update_info dict of a shared export: plain values only (it crosses vLLM's RPC to every worker)."""
    return {"node_id": shared.node_id, "pid": shared.pid, "fd": shared.fd, "token": shared.token.hex(),
            "generation": shared.generation, "nbytes": shared.nbytes,
            "entries": [[n, d, list(s), o] for n, d, s, o in shared.entries]}


class SharedMemoryTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """The worker side of `gspo_shm`: layer-wise reload around `model.load_weights` of the mapped export."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.report: dict[str, Any] = {}
        if torch.device(device).type == "cpu":  # this worker's pushes reuse the previous push's pages
            keep_push_memory()

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.report = {"tensors": 0}
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Load one chunk. A failure is recorded in the report, not raised: vLLM 0.32's multi-process executor
        raises at the first worker's failure and leaves the other workers' replies queued, where the next call
        (the repairing push) reads them as its own. The engine raises from the reports instead."""
        if self.report.get("error"):
            return
        try:  # the base class also synchronises the accelerator; CPU tensors are written when load_weights returns
            self.receive_weights(self.parse_update_info(update_info))
        except Exception as e:  # noqa: BLE001 - reported to the engine, which raises WeightSyncError
            self.report["error"] = f"{type(e).__name__}: {e}"

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        weights = update_info.local if update_info.local is not None else read_shared(update_info.record())

        def counted():
            for pair in weights:
                self.report["tensors"] += 1
                yield pair

        self.model.load_weights(counted())

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        from gspo_ray.compat.vllm_cpu_reload import apply_reload_fix

        if self.report.get("error"):  # half-loaded layers stay as they are: only a complete push repairs them
            return
        finalize_layerwise_reload(self.model, self.model_config)
        self.report |= apply_reload_fix(self.model)  # re-packed MoE experts, re-dispatched tied lm_head

    def shutdown(self) -> None:
        pass


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
PUSH_HEAP_MMAP_THRESHOLD = 256 * 2**20  # above the largest tensor a push materialises (SmolLM2's embedding: 113 MB)


def keep_push_memory() -> bool:
    """Let this engine process reuse the memory of one weight push in the next: allocations up to 256 MiB come from
    the heap (not a fresh mmap each) and freed heap is not trimmed. vLLM's layer-wise reload materialises every layer
    afresh and re-packs every linear, so each push otherwise faults ~the model's bytes of new pages in twice.
    Measured (SmolLM2-135M fp32, in-process engine on one core, median of 6 pushes from the shared file): 0.54 s ->
    0.46 s (0.43 s when set as MALLOC_* variables before the process starts). The price: the process keeps its push
    peak resident (the materialised layers and packed weights of one push). glibc only; False where it is absent."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, PUSH_HEAP_MMAP_THRESHOLD)
                    and libc.mallopt(M_TRIM_THRESHOLD, 2**34))
    except (OSError, AttributeError):  # not glibc
        return False


def push_engine_kwargs() -> dict[str, Any]:
    """`LLM(...)` keyword arguments of an engine that takes pushes through this backend."""
    return {"weight_transfer_config": {"backend": BACKEND}, "worker_extension_cls": EXTENSION}


class PushReportExtension:
    """Mixed into every vLLM worker by `worker_extension_cls` (importing this module registers the backend).
    Its methods are called by name through `collective_rpc`, so they work across worker processes."""

    def gspo_push_report(self) -> dict[str, Any]:
        """What this worker's last push did: tensors read, MoE layers re-packed, lm_head re-dispatched."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "report", {}))

    def gspo_router_counts_begin(self, top_k: int) -> None:
        """Start counting the tokens each MoE router of this worker's model sends to each expert."""
        from gspo_ray.rollout.expert_coverage import RouterCounter

        self.gspo_router_counter = RouterCounter(self.get_model(), top_k).__enter__()

    def gspo_router_counts_end(self) -> dict[str, list[int]]:
        """Stop counting; {MoE block: tokens per expert} since `gspo_router_counts_begin` (plain lists: they
        cross vLLM's RPC)."""
        counter = getattr(self, "gspo_router_counter", None)
        if counter is None:
            return {}
        counter.__exit__(None, None, None)
        self.gspo_router_counter = None
        return {name: c.tolist() for name, c in counter.counts.items()}


try:
    WeightTransferEngineFactory.register_engine(BACKEND, SharedMemoryTransferEngine)
except ValueError:  # already registered in this process (a re-import)
    pass
apply_seeded_prefill_fix()  # in every worker process of a multi-process engine, which imports this module
apply_mla_rope_fix()  # the same processes: DeepSeek MLA's rotary on the CPU kernel
