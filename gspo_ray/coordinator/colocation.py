"""Colocated pools: which GPU each trainer rank and each rollout engine is placed on. Pure functions of the layout
(no Ray here: coordinator/pools.py places them).

    groups = node_groups(num_ranks=16, tp=2, node_gpus=[8, 8])         # [8, 8]: one placement group per node
    slots = engine_slots(groups, tp=2)                                 # engine 0 -> group 0, bundles (0, 1), ...
    rank_bundles(groups)                                               # rank r -> (group, bundle)
    visible_devices([["3"], ["4"]], slots[0])                          # "3,4": the engine's CUDA_VISIBLE_DEVICES

Colocated (rollout and trainer num_gpus_per_worker both below 1; config/rollout.colocation_problem refuses what
cannot be placed): every trainer rank has a GPU of its own, one bundle {"GPU": 1} of a STRICT_PACK placement group
per node. Engine i spans the `tp` consecutive bundles of ranks i*tp .. i*tp + tp-1, all on one node. Ray cannot
give one actor fractions of k GPUs, so the engine actor asks for no GPU: it sits in the first of its bundles and
names its GPUs itself (CUDA_VISIBLE_DEVICES from the GPU ids Ray gave those bundles). The trainer rank asks for its
fraction of its bundle's GPU, so Ray sets its CUDA_VISIBLE_DEVICES to that same GPU.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSlot:
    """Where one colocated engine sits: placement group `group`, bundles `bundles` (its actor in the first)."""

    group: int
    bundles: tuple[int, ...]


def node_groups(num_ranks: int, tp: int, node_gpus: list[int]) -> list[int]:
    """Bundles (= trainer ranks = GPUs) of each node's placement group: nodes filled in the order given (largest
    first is the caller's choice), each group a multiple of `tp` so that no engine spans two nodes. Raises
    ValueError when the nodes' GPUs cannot hold the ranks that way."""
    if num_ranks % tp:
        raise ValueError(f"{num_ranks} trainer ranks do not split into engines of {tp} GPUs")
    groups, left = [], num_ranks
    for gpus in node_gpus:
        if left == 0:
            break
        take = min(left, gpus // tp * tp)
        if take:
            groups.append(take)
            left -= take
    if left:
        raise ValueError(f"colocated pools need {num_ranks} GPUs in blocks of {tp} on one node "
                         f"(rollout.tensor_parallel_size); the cluster's nodes have {node_gpus} GPUs")
    return groups


def rank_bundles(groups: list[int]) -> list[tuple[int, int]]:
    """(placement group, bundle) of each trainer rank, rank order: group 0's bundles, then group 1's, ..."""
    return [(g, b) for g, size in enumerate(groups) for b in range(size)]


def engine_slots(groups: list[int], tp: int) -> list[EngineSlot]:
    """Each engine's bundles: engine i takes ranks i*tp .. i*tp + tp-1, which `node_groups` keeps on one node."""
    return [EngineSlot(g, tuple(range(first, first + tp))) for g, size in enumerate(groups)
            for first in range(0, size, tp)]


def bundle_shapes(size: int, tp: int, trainer_cpus: float, engine_cpus: float, trainer_resources: dict,
                  engine_resources: dict) -> list[dict[str, float]]:
    """The bundles of one node's group: each holds a trainer rank (its CPUs and custom resources) and one GPU; the
    first bundle of each engine also holds the engine actor's CPUs and resources (the engine asks for no GPU)."""
    shapes = []
    for b in range(size):
        shape = {"CPU": trainer_cpus, "GPU": 1.0, **trainer_resources}
        if b % tp == 0:
            shape["CPU"] += engine_cpus
            for key, value in engine_resources.items():
                shape[key] = shape.get(key, 0.0) + value
        shapes.append(shape)
    return shapes


def visible_devices(bundle_gpu_ids: list[list[str]], slot: EngineSlot) -> str:
    """The engine's CUDA_VISIBLE_DEVICES: the GPU ids Ray gave its bundles (`bundle_gpu_ids[b]`: bundle b's ids,
    one GPU each), in bundle order, so the engine's device j is the GPU of its j-th rank."""
    ids = []
    for b in slot.bundles:
        if len(bundle_gpu_ids[b]) != 1:
            raise ValueError(f"bundle {b} of group {slot.group} holds GPUs {bundle_gpu_ids[b]}, not one")
        ids.append(str(bundle_gpu_ids[b][0]))
    return ",".join(ids)


def shares_trainer_gpus(engine_devices: set[tuple[str, str]], rank_devices: set[tuple[str, str]]) -> bool:
    """Whether every GPU of an engine ((node id, GPU id) pairs, as Ray placed them) is a trainer rank's: the
    condition of vLLM's ipc backend (the engine maps the trainer's tensors on the GPU they share)."""
    return bool(engine_devices) and engine_devices <= rank_devices


def free_slot(num_slots: int, held: dict[int, int], alive: set[int]) -> int | None:
    """The first engine slot no live engine holds. held: slot -> the worker id last placed there; alive: the worker
    ids still running. None when every slot is held (a colocated pool cannot grow past its GPUs)."""
    for slot in range(num_slots):
        if held.get(slot) not in alive:
            return slot
    return None
