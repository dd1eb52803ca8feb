"""How a push reaches the engines (`rollout.weight_transfer`), and the engine side of vLLM's CUDA backends.

    check_weight_transfer("nccl", engine_on_gpu=False, trainer_on_gpu=False)     # ValueError: one line, the field
    choose_weight_transfer("auto", engine_on_gpu=True, trainer_on_gpu=True, same_gpu=False, same_node=True) # "nccl"
    LLM(..., **engine_transfer_kwargs("nccl"))                          # weight_transfer_config + our extension
    trainer_info, worker_info = nccl_init_infos("10.0.0.1", 29600, engine_workers=[2, 2])   # vLLM's own records
    client = ActorPoolClient(rollout_actors, [tensor_parallel_size] * len(rollout_actors), timeout_s=600)

Transports (the field's values, `auto` resolved by `choose_weight_transfer` once the placement is known):
- `shm`: the trainer's shared-memory export, mapped by every TP worker of an engine on the same node (our
  `gspo_shm` backend, rollout/shm_transfer.py). CPU or GPU engines.
- `object_store`: buckets through Ray's object store to an engine on another node, loaded through `gspo_shm`.
- `nccl`: vLLM's `nccl` backend: trainer rank 0 broadcasts every tensor to every engine worker in one NCCL group
  (world 1 + all engine workers; engine i's workers at ranks 1 + the TP sizes of engines 0..i-1). Trainer and
  engines on CUDA, on different GPUs (same node or not).
- `ipc`: vLLM's `ipc` backend: the engine maps the trainer's gathered tensors on the GPU they share (CUDA IPC
  handles, no copy over any link). Trainer and engine on the same GPUs.
`auto`: CPU engines as before this field (shm on the trainer's node, the object store elsewhere); CUDA engines and
trainer: ipc where they share a GPU, nccl otherwise.

The engine side of `nccl` / `ipc` is vLLM's: an engine started with `engine_transfer_kwargs` creates vLLM's
backend in each worker; its rendezvous (`init_weight_transfer_engine`) waits for the trainer's
(`trainer/weights/weight_send.start_sender`), and every push is vLLM's `start_weight_update` / `update_weights` /
`finish_weight_update`, driven by the trainer-side engine through `EnginePoolClient`. Not run on a GPU here.
"""
from __future__ import annotations

from typing import Any

from gspo_ray.config.rollout import gpu_colocated

FIELD = "rollout.weight_transfer"
TRANSPORTS = ("auto", "shm", "object_store", "nccl", "ipc")
CUDA_TRANSPORTS = ("nccl", "ipc")
SHM_BACKEND = "gspo_shm"  # shm_transfer.BACKEND (not imported: that module imports vLLM)


def check_weight_transfer(requested: str, *, engine_on_gpu: bool, trainer_on_gpu: bool) -> None:
    """Refuse a transport the devices cannot use (before Ray starts): ValueError, one line naming the field."""
    if requested not in TRANSPORTS:
        raise ValueError(f"{FIELD} {requested!r} is not one of {', '.join(TRANSPORTS)}")
    if requested in CUDA_TRANSPORTS and not (engine_on_gpu and trainer_on_gpu):
        where = " and ".join(f"{who} on CPU ({field}.num_gpus_per_worker 0)" for who, field, gpu in
                             (("the engines are", "rollout", engine_on_gpu),
                              ("the trainer is", "trainer", trainer_on_gpu)) if not gpu)
        raise ValueError(f"{FIELD} {requested!r} moves CUDA tensors, but {where}; valid here: auto, shm, "
                         "object_store")


def choose_weight_transfer(requested: str, *, engine_on_gpu: bool, trainer_on_gpu: bool, same_gpu: bool,
                           same_node: bool) -> str:
    """The transport of one engine's pushes: shm | object_store | nccl | ipc. same_gpu: the engine's GPUs are
    GPUs of the trainer ranks; same_node: the engine runs on trainer rank 0's node. Raises ValueError (naming
    the field) where the requested transport cannot reach this engine."""
    check_weight_transfer(requested, engine_on_gpu=engine_on_gpu, trainer_on_gpu=trainer_on_gpu)
    if requested == "auto":
        if engine_on_gpu and trainer_on_gpu:
            return "ipc" if same_gpu else "nccl"
        return "shm" if same_node else "object_store"
    if requested == "ipc" and not same_gpu:
        raise ValueError(f"{FIELD} 'ipc' needs the engine on the trainer's GPUs; this engine has GPUs of its own: "
                         "use nccl (or auto)")
    if requested == "shm" and not same_node:
        raise ValueError(f"{FIELD} 'shm' reaches engines on trainer rank 0's node only; this engine is on "
                         "another node: use object_store (or auto)")
    return requested


def resolve_weight_transfer(requested: str, *, rollout_gpus: float, trainer_gpus: float,
                            lora_serve: str | None = None) -> str:
    """The job's transport, once, before any engine starts (`coordinator/pools.py`): shm | object_store | nccl |
    ipc. CPU engines or a CPU trainer: `auto` -> "shm", the `gspo_shm` family as before the field (each push's
    `export_plan` still writes the file only where an engine shares trainer rank 0's node and sends object-store
    refs elsewhere). CUDA on both sides: `auto` -> "ipc" where the engines share the trainer's GPUs (both
    num_gpus_per_worker fractional: `config.rollout.gpu_colocated`, the rule that sizes gpu_memory_utilization), else
    "nccl". An explicit value is checked against the devices (ValueError naming the field) and kept.

    lora_serve: trainer.lora.serve when trainer.lora is set (None: full fine-tuning). "merged": the engines get full
    weights W + (alpha / rank) B A, pushed like full fine-tuning's (nccl / ipc read the trainer's merged view,
    trainer/weights/weight_send.py). "adapter": the engines load the adapter through vLLM's LoRA API, which only the
    trainer's export carries (on CUDA engines, where nccl / ipc run, an MoE serves the adapter too), so `auto` stays
    "shm" and nccl / ipc are refused."""
    engine_on_gpu, trainer_on_gpu = rollout_gpus > 0, trainer_gpus > 0
    check_weight_transfer(requested, engine_on_gpu=engine_on_gpu, trainer_on_gpu=trainer_on_gpu)
    adapter = lora_serve == "adapter"
    if adapter and requested in CUDA_TRANSPORTS:
        raise ValueError(f"{FIELD} {requested!r} sends full weights; trainer.lora.serve adapter pushes the adapter "
                         "through vLLM's LoRA API (the trainer's export): valid with it: auto, shm, object_store "
                         "(or trainer.lora.serve merged)")
    if requested != "auto":
        return requested
    if engine_on_gpu and trainer_on_gpu and not adapter:
        return choose_weight_transfer("auto", engine_on_gpu=True, trainer_on_gpu=True,
                                      same_gpu=gpu_colocated(rollout_gpus, trainer_gpus), same_node=True)
    return "shm"


def job_weight_transfer(cfg) -> str:
    """A job's transport (`resolve_weight_transfer` of its config: rollout.weight_transfer, both pools'
    num_gpus_per_worker, trainer.lora.serve): the one answer the preflight, the workers' config and the
    coordinator's pushes share."""
    lora = cfg.trainer.lora
    return resolve_weight_transfer(cfg.rollout.weight_transfer, rollout_gpus=cfg.rollout.num_gpus_per_worker,
                                   trainer_gpus=cfg.trainer.num_gpus_per_worker,
                                   lora_serve=lora.serve if lora is not None else None)


# One nccl / ipc push, as the scale model counts it (bench/scale_sync.py, docs/scale.md "Weight sync per transport"):
# every engine worker takes in the model's HF bytes M once, from one broadcast (nccl) or by mapping the trainer's
# gathered copy on its own GPU (ipc). The rates are assumptions, not measurements (nothing here has run on a GPU):
# nccl at a 100 Gb/s network's half (the broadcast crosses nodes), ipc at a fraction of a GPU's copy rate (gather,
# pack, map, load per bucket), plus the fixed cost of the rendezvous and vLLM's layerwise reload start / finish.
PUSH_BYTES_PER_S = {"nccl": 6e9, "ipc": 25e9}
PUSH_FIXED_S = 30.0


def estimate_push_s(model_bytes: int, transport: str) -> float:
    """Seconds one nccl / ipc push of a model of `model_bytes` HF bytes (in the trainer's dtype) is expected to
    take (the assumptions above); the floor rollout.push_timeout_s is checked against."""
    if transport not in CUDA_TRANSPORTS:
        raise ValueError(f"no push estimate for {transport!r} (nccl, ipc)")
    return PUSH_FIXED_S + model_bytes / PUSH_BYTES_PER_S[transport]


def describe_transport(transport: str) -> str:
    """How pushes reach the engines, for the job's engines line."""
    if transport in CUDA_TRANSPORTS:
        return f"vLLM's {transport} backend, sent from the trainer's shards (rollout.weight_transfer {transport})"
    if transport == "object_store":
        return f"{SHM_BACKEND}, through Ray's object store (rollout.weight_transfer object_store)"
    return (f"{SHM_BACKEND}: the shared-memory file on trainer rank 0's node, the object store elsewhere "
            f"(rollout.weight_transfer {transport})")


def engine_backend(transport: str) -> str:
    """vLLM's weight-transfer backend an engine is started with for `transport`."""
    return transport if transport in CUDA_TRANSPORTS else SHM_BACKEND


def engine_transfer_kwargs(transport: str) -> dict[str, Any]:
    """`LLM(...)` keyword arguments for an engine taking `transport` pushes. Our worker extension rides along in
    every case (per-worker push reports, the probe's router counts; importing it registers `gspo_shm`)."""
    from gspo_ray.rollout.shm_transfer import push_engine_kwargs

    return push_engine_kwargs() | {"weight_transfer_config": {"backend": engine_backend(transport)}}


def nccl_init_infos(master_address: str, master_port: int, engine_workers: list[int], *, rank: int = 0,
                    packed_buffer_bytes: int | None = None):
    """vLLM's `NCCLTrainerInitInfo` for trainer rank `rank` and the `NCCLWeightTransferInitInfo` its
    trainer_init sends the engines (rank_offset 1: `EnginePoolClient` shifts it per engine). engine_workers:
    each engine's worker count (its TP size). One group for every engine: one broadcast reaches them all."""
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    if not engine_workers or min(engine_workers) < 1:
        raise ValueError(f"engine_workers must list each engine's workers (>= 1), got {engine_workers}")
    sizes = {} if packed_buffer_bytes is None else {"packed_buffer_size_bytes": packed_buffer_bytes}
    trainer = NCCLTrainerInitInfo(master_address=master_address, master_port=master_port,
                                  world_size=1 + sum(engine_workers), rank=rank, **sizes)
    worker = NCCLWeightTransferInitInfo(master_address=master_address, master_port=master_port, rank_offset=1,
                                        world_size=trainer.world_size, packed=trainer.packed,
                                        packed_buffer_size_bytes=trainer.packed_buffer_size_bytes,
                                        packed_num_buffers=trainer.packed_num_buffers)
    return trainer, worker


def ipc_init_info(*, rank: int = 0, packed_buffer_bytes: int | None = None):
    """vLLM's `IPCTrainerInitInfo` for trainer rank `rank` (packed: one reusable IPC buffer of that size,
    bounded memory, what the job's pushes use; unpacked when None: one handle per tensor, the whole model shared
    at once and held by every trainer GPU until `finish_weight_update`)."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    if packed_buffer_bytes is None:
        return IPCTrainerInitInfo(rank=rank)
    return IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=packed_buffer_bytes)


WEIGHT_TRANSFER_CALLS = ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                         "finish_weight_update",  # vLLM's four phases, the methods of every LLM
                         "shutdown_weight_transfer_engine")  # and its release of the last rendezvous's group


class EnginePoolClient:
    """vLLM's `VLLMWeightSyncClient` (four methods, plain dicts) over a pool of engines, each one vLLM `LLM`: every
    call goes to every engine at once (`_all`, `ActorPoolClient`'s over rollout actors), since the NCCL rendezvous
    and broadcast block until every worker of the group has joined. The NCCL init record is re-addressed per
    engine: vLLM numbers a worker `rank_offset + its rank in the engine`, and each of our engines is its own `LLM`,
    so engine i gets rank_offset 1 + the workers of engines 0..i-1."""

    def __init__(self, targets: list, engine_workers: list[int]) -> None:
        if len(targets) != len(engine_workers):
            raise ValueError(f"{len(targets)} engines, {len(engine_workers)} worker counts")
        self.targets, self.engine_workers = targets, list(engine_workers)
        self.fault: EngineTransferError | None = None

    def engine_init_infos(self, init_info: dict[str, Any]) -> list[dict[str, Any]]:
        """Each engine's init record: NCCL's with its own rank_offset (the world must hold them all), any other
        backend's unchanged."""
        if "rank_offset" not in init_info:
            return [dict(init_info) for _ in self.targets]
        expected = 1 + sum(self.engine_workers)
        if init_info.get("world_size") != expected:
            raise ValueError(f"NCCL world_size {init_info.get('world_size')} != 1 trainer + "
                             f"{sum(self.engine_workers)} engine workers")
        offsets = [init_info["rank_offset"] + sum(self.engine_workers[:i]) for i in range(len(self.targets))]
        return [init_info | {"rank_offset": off} for off in offsets]

    # `fault`: the first engine fault of a phase, set as soon as it is seen. vLLM's nccl sender runs update_weights
    # on a side thread and never reads its error while its broadcast blocks; trainer rank 0's watchdog
    # (trainer/weights/weight_send.send_bounded) reads it here and aborts the broadcast.

    def _all(self, method: str, requests: list[Any]) -> None:
        """`method` on every engine at once, request i to engine i; returns once all are done."""
        raise NotImplementedError

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """A new rendezvous: each engine's previous transfer engine released first (vLLM's worker would assign
        the new NCCL group over the old one and leak it). An engine that cannot release it (alive, its call
        raised: e.g. a push left unfinished) keeps it and still joins; a lost one fails the phase."""
        try:
            self._all("shutdown_weight_transfer_engine", [None] * len(self.targets))
        except EngineTransferError as e:
            if e.dead or e.hung:
                raise
            self.fault = None  # a refused release is not a fault of the push
        self._all("init_weight_transfer_engine", [{"init_info": i} for i in self.engine_init_infos(init_info)])

    def start_weight_update(self) -> None:
        self._all("start_weight_update", [None] * len(self.targets))

    def update_weights(self, update_info) -> None:
        self._all("update_weights", [{"update_info": update_info}] * len(self.targets))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", [None] * len(self.targets))


class EngineTransferError(RuntimeError):
    """A phase of an nccl / ipc push that some rollout engines did not complete, each listed by its index in the
    client's targets: `dead` (its actor died), `hung` (no answer in the client's timeout_s), `failed` (alive, its
    call raised). `ActorPoolClient` raises it instead of Ray's actor errors: a RayActorError raised inside trainer
    rank 0's method reaches the driver as an instance of RayActorError (Ray's `as_instanceof_cause`), which the
    trainer pool takes for the rank's own death (TrainerRankDied, a whole trainer recovery) while the fault is one
    engine's. The coordinator drops the engines and pushes again (coordinator/transfer_push.py)."""

    def __init__(self, method: str, dead=(), hung=(), failed=(), detail: str = "") -> None:
        self.method, self.dead, self.hung, self.failed = method, list(dead), list(hung), list(failed)
        self.detail = detail
        super().__init__(method, self.dead, self.hung, self.failed, detail)  # all of them: it pickles through Ray

    def __str__(self) -> str:
        parts = [f"{what} {idx}" for what, idx in (("dead", self.dead), ("no answer", self.hung),
                                                   ("raised", self.failed)) if idx]
        return (f"{self.method}: rollout engine(s) of the push not done ({'; '.join(parts)})"
                + (f": {self.detail}" if self.detail else ""))


def engine_transfer_fault(error: BaseException | None) -> EngineTransferError | None:
    """The EngineTransferError behind `error` (itself, a trainer pool error's `cause`, a RayTaskError's, or the
    chained `__cause__`), or None."""
    for _ in range(8):
        if error is None or isinstance(error, EngineTransferError):
            return error
        error = getattr(error, "cause", None) or error.__cause__
    return None


class ActorPoolClient(EnginePoolClient):
    """`EnginePoolClient` over rollout actors (Ray handles of `RolloutWorker`): each phase is one
    `weight_transfer_call.remote(method, request)` per actor, all sent before any is waited for, then every one
    waited for (a failure is raised once all have answered or failed, or `timeout_s` passed: NCCL peers must not
    be left behind in a half-sent phase by an early exit). A phase some engines did not complete raises
    EngineTransferError naming them, never a Ray actor error. Lives where vLLM's trainer-side engine runs (trainer
    rank 0)."""

    def __init__(self, handles: list, engine_workers: list[int], timeout_s: float | None = None) -> None:
        super().__init__(list(handles), engine_workers)
        self.timeout_s = timeout_s

    def _all(self, method: str, requests: list[Any]) -> None:
        import time

        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        refs = [h.weight_transfer_call.remote(method, r) for h, r in zip(self.targets, requests)]
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        waiting, dead, failed, detail = list(refs), [], [], ""
        while waiting:  # one at a time: a death is reported at once, the others still waited for
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            done, waiting = ray.wait(waiting, num_returns=1, timeout=left)
            if not done:
                break
            i = refs.index(done[0])
            try:
                ray.get(done[0], timeout=0)
            except (RayActorError, ActorDiedError, ActorUnavailableError) as e:
                dead.append(i)
                detail = detail or type(e).__name__
                if self.fault is None:  # its peers may never finish this phase (an NCCL group with a dead member)
                    self.fault = EngineTransferError(method, dead, (), failed, detail)
            except Exception as e:  # noqa: BLE001 - alive, its call raised: named, the first one's line kept
                failed.append(i)
                cause = getattr(e, "cause", None) or e
                detail = detail or f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[-1]}"
        hung = sorted(refs.index(ref) for ref in waiting)
        if hung:
            detail = f"no answer in {self.timeout_s} s" + (f"; {detail}" if detail else "")
        if dead or hung or failed:
            error = EngineTransferError(method, sorted(dead), hung, sorted(failed), detail)
            self.fault = self.fault or error
            raise error
