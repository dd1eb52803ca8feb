"""The trainer side of a push through vLLM 0.32's own CUDA backends (`nccl`, `ipc`): Megatron's shards as vLLM's
`WeightSource`, sent by vLLM's trainer-side engine.

    source = MegatronWeightSource.for_backend("nccl", gpt, spec, int(cfg.trainer.export_bucket_mb * 2**20))
    sender = start_sender(init_info, client, source)   # every trainer rank; rank 0 rendezvouses with the engines
    sender.send_weights()                              # every trainer rank, every push: start / update / finish

`init_info` is vLLM's own trainer init record (`NCCLTrainerInitInfo` / `IPCTrainerInitInfo`, built by
`rollout/weight_transfer.py`), `client` anything with vLLM's `VLLMWeightSyncClient` methods (the engines' four
phases; `rollout/weight_transfer.EnginePoolClient`). `WeightTransferTrainerFactory.trainer_init` picks the engine
from the record's `backend`:

- `nccl` (`NCCLTrainerWeightTransferEngine`): trainer rank 0 broadcasts every tensor (packed into
  `packed_buffer_size_bytes` buffers) to every engine worker in one NCCL group; the other ranks iterate the source
  only, to stay in its gathers. Each engine worker receives the whole model and its weight loaders keep its shard.
- `ipc` (`IPCTrainerWeightTransferEngine`): every trainer rank shares its gathered tensors by CUDA IPC handle; the
  handles are all-gathered over the default process group and rank 0 sends them; each engine worker maps the
  copy on its own GPU. Trainer and engine must share GPUs.

Iteration is collective (at most one TP and one EP collective per bucket, `trainer/weights/weight_buckets.py`): every
trainer rank iterates in the same order, which both vLLM trainer engines do (non-senders replay the source). For
`nccl` each bucket is gathered to rank 0 only (the others yield None for what they do not hold, vLLM's convention;
its non-senders only iterate); for `ipc` to every rank.

With trainer.lora and merged pushes (trainer.lora.serve merged) the source reads the model's merged view
(`trainer/lora/peft_io.MergedView`, `push_model`): each adapted weight is W + (alpha / rank) B A, merged when its
bucket is gathered, so one bucket's merged tensors are alive at a time and every push reads the adapters of that
push. Adapter pushes (serve adapter) do not come here: the engines load the adapter through vLLM's LoRA API.

Not run on a GPU (none reaches this project with a CUDA build of vLLM): the two engines' CUDA data paths. Our part
(the plan, the gather order, metadata agreeing with iteration, the init records, the merged view's tensors) is
tested on CPU.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import Tensor
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from gspo_ray.trainer.families import family_of
from gspo_ray.trainer.lora.peft_io import MergedView
from gspo_ray.trainer.push_guard import PushGate, send_bounded
from gspo_ray.trainer.model_spec import ModelSpec
from gspo_ray.trainer.weights.bridge import named_weights
from gspo_ray.trainer.weights.weight_buckets import Collect, WeightBucket, gather_bucket, plan_buckets, torch_collect


class MegatronWeightSource(WeightSource):
    """vLLM's `WeightSource` over a Megatron model's shards: full HF tensors, gathered bucket by bucket.

    tp_group / ep_group: the model's TP and expert-parallel groups (None: Megatron's parallel_state when the model
    is sharded over them). model: a Megatron model (its `named_parameters()`, held by name: the live parameters, read
    at each push) or a mapping name -> local tensor; a mapping whose values are computed when read gives its names,
    shapes and dtypes through `param_meta()` and is read at every push, bucket by bucket (`trainer/lora/peft_io.
    MergedView`: W + scale B A of the adapters as they are at that push; `gather_bucket` holds one bucket's values
    at a time). to_root: gather each bucket to global rank 0 only (`nccl`: only it sends; the other
    ranks yield None for what they do not hold) instead of to every rank (`ipc`: every rank's GPU serves its own
    engine workers); `for_backend` picks it. collect(tensor, group, to_root): torch.distributed's by default."""

    def __init__(self, model, spec: ModelSpec, bucket_bytes: int = 64 * 2**20, tp_group=None, ep_group=None,
                 to_root: bool = False, collect: Collect = torch_collect,
                 before_gathers: Callable[[], None] | None = None) -> None:
        if hasattr(model, "param_meta"):  # values computed when read (MergedView): planned without reading them
            self._params, meta = model, list(model.param_meta())
        else:
            self._params = dict(named_weights(model) if hasattr(model, "named_parameters") else model.items())
            meta = [(n, tuple(t.shape), t.dtype) for n, t in self._params.items()]
        if family_of(spec.arch).fuses_experts_on_export:  # made by export_hf_weights, not planned per bucket
            raise NotImplementedError(f"{spec.arch} pushes through vLLM's nccl / ipc weight transfer (fused "
                                      "experts) are not built; its pushes go through export_hf_weights")
        self.spec = spec
        self.plan: list[WeightBucket] = plan_buckets(meta, spec, bucket_bytes)
        if (spec.tp > 1 and tp_group is None) or (spec.ep > 1 and ep_group is None):
            from megatron.core import parallel_state as ps

            tp_group = tp_group or (ps.get_tensor_model_parallel_group() if spec.tp > 1 else None)
            ep_group = ep_group or (ps.get_expert_model_parallel_group() if spec.ep > 1 else None)
        self.tp_group, self.ep_group, self.to_root, self.collect = tp_group, ep_group, to_root, collect
        self.before_gathers = before_gathers  # once per iteration, before the first bucket's gathers (PushGate)

    @classmethod
    def for_backend(cls, backend: str, model, spec: ModelSpec, bucket_bytes: int,
                    before_gathers: Callable[[], None] | None = None) -> "MegatronWeightSource":
        """The source vLLM's `backend` ("nccl" | "ipc") needs: gathered to rank 0 for nccl, to every rank for
        ipc."""
        if backend not in ("nccl", "ipc"):
            raise ValueError(f"no trainer-side sender for weight transfer backend {backend!r} (nccl, ipc)")
        return cls(model, spec, bucket_bytes, to_root=backend == "nccl", before_gathers=before_gathers)

    def metadata(self) -> list[ParamMeta]:
        """Every HF tensor of the push (name, dtype, full shape), from the plan: no gather."""
        return [ParamMeta(hf_name, p.dtype, shape) for bucket in self.plan for p in bucket.params
                for hf_name, shape in p.hf]

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        if self.before_gathers is not None:
            self.before_gathers()
        with torch.no_grad():
            for bucket in self.plan:
                yield from gather_bucket(bucket, self._params, self.spec, self.tp_group, self.ep_group,
                                         self.to_root, self.collect)


def start_sender(init_info, client, source: WeightSource):
    """vLLM's trainer-side engine for `init_info`'s backend, after its rendezvous with the engines (on every
    trainer rank; only rank 0 calls the client). Its `send_weights()` is one push."""
    return WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)


class TransferSender:
    """One trainer rank's side of the job's pushes through vLLM's `nccl` / `ipc` backends (`send_on_rank`, from
    TrainerPool `send_by_transfer`): vLLM's trainer-side engine (`sender`), started (with its rendezvous) on the
    first push and again whenever the engine set changes (`key`: the engines' ids), then one `send_weights()` per
    push. On rank 0, vLLM's engine drives the client (the rollout actors' phases) under `send_bounded`'s
    watchdog; the other ranks only join the gathers. A sender is shut down (vLLM's `shutdown`: its NCCL group
    destroyed) when another replaces it and when a push through it fails: after a failed broadcast vLLM's group
    is unusable, so the next push starts a new one even for the same engines."""

    def __init__(self, key, sender) -> None:
        self.key, self.sender = key, sender

    def shutdown(self) -> None:
        """Release vLLM's sender (its NCCL communicator on rank 0; nothing elsewhere)."""
        shutdown = getattr(self.sender, "shutdown", None)
        if shutdown is not None:
            shutdown()

    @classmethod
    def push(cls, previous: "TransferSender | None", key, start: Callable[[], object], *, is_sender: bool,
             timeout_s: float | None = None) -> "TransferSender":
        """Send one push, through `previous` when it serves the same engines, else through `start()`'s new sender
        (`previous` shut down first: its engines are rendezvousing anew). Rank 0 (`is_sender`) sends under the
        watchdog (`send_bounded`, `timeout_s`). Returns the sender to keep; on any error the sender used is shut
        down and the error raised (keep none)."""
        if previous is not None and previous.key != key:
            previous.shutdown()
            previous = None
        sender = previous if previous is not None else cls(key, start())
        try:
            if is_sender:
                client = getattr(sender.sender, "client", None)
                send_bounded(sender.sender.send_weights, lambda: getattr(client, "fault", None), sender.shutdown,
                             timeout_s, reset=lambda: setattr(client, "fault", None) if client is not None else None)
            else:
                sender.sender.send_weights()
        except BaseException:
            sender.shutdown()
            raise
        return sender


def push_model(worker):
    """What a rank's nccl / ipc pushes read: the model, or with trainer.lora and merged pushes
    (`TrainerLoRA.merged_push`: trainer.lora.serve merged; on CUDA engines an MoE serves the adapter) its merged view
    `MergedView(gpt)`: W + (alpha / rank) B A of each adapted weight, computed bucket by bucket at each push from the
    adapters as they are then, in the base weight's dtype (trainer.dtype, what the plan's metadata declares and
    vLLM's senders check; the engines' weight loaders cast to rollout.dtype as for full weights). Adapter pushes
    are refused: they go through vLLM's LoRA API."""
    if worker.lora is None:
        return worker.gpt
    if not worker.lora.merged_push:
        raise ValueError("rollout.weight_transfer nccl / ipc sends full weights; trainer.lora.serve adapter pushes "
                         "the adapter through vLLM's LoRA API (the trainer's export): use rollout.weight_transfer "
                         "auto, shm or object_store, or trainer.lora.serve merged")
    return MergedView(worker.gpt)


def send_on_rank(worker, key, init_infos: list, client, timeout_s: float | None = None,
                 start: Callable = start_sender) -> None:
    """One nccl / ipc push on one trainer rank, run inside its TrainerWorker actor (TrainerPool.send_by_transfer,
    through Ray's `__ray_call__`): the rank's `TransferSender`, kept on the worker between pushes (dropped while
    a push runs: a failed one keeps none), over `push_model(worker)` (the model, or its merged LoRA view).
    timeout_s: rollout.push_timeout_s, rank 0's watchdog and the other ranks' wait for its start (`PushGate`:
    they enter the bucket gathers only once the engines accepted `start_weight_update`). start(init_info, client,
    source): vLLM's sender (`start_sender`; a stand-in in CPU tests)."""
    previous, worker.transfer_sender = getattr(worker, "transfer_sender", None), None
    gate = getattr(worker, "push_gate", None)
    if gate is None:  # every rank's first push, together: the gate's group is created collectively
        gate = worker.push_gate = PushGate.create(worker.rank, timeout_s)
    gate.begin()
    init_info = init_infos[worker.rank]
    source = lambda: MegatronWeightSource.for_backend(  # noqa: E731 - built only when a sender starts
        init_info.backend, push_model(worker), worker.spec, int(worker.cfg.export_bucket_mb * 2**20),
        before_gathers=gate.pass_through)
    try:
        worker.transfer_sender = TransferSender.push(previous, key, lambda: start(init_info, client, source()),
                                                     is_sender=worker.rank == 0, timeout_s=timeout_s)
    finally:
        gate.end()  # rank 0 failed before its start: the others, waiting at the gate, are let go (refused)
