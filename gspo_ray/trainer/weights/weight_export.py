"""A trainer rank's weight export for a rollout push: the `WeightExport` record, and the exporter that fills it from
the HF-named buckets the rank gathers (in-process copies, object-store refs, or rank 0's shared-memory file).

    exporter = WeightExporter(rank)
    export = exporter.export(source, version, bucket_mb, as_refs=False, shared=False)   # collective iteration
    exporter.close()                                                                   # at shutdown

`source` is an iterator of buckets, each a list of (HF name, tensor) (bridge.export_hf_weights, or the LoRA
adapters' / merged weights, lora.worker.TrainerLoRA.weights). Every rank iterates it to the end (its gathers are
collective); only rank 0 keeps anything.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator


@dataclass
class WeightExport:
    """Full HF-named weights of one policy version, in buckets (rank 0 fills `buckets`; other ranks leave it empty).
    A bucket is a list of (HF name, tensor), or a Ray ref to one (`export_weights(as_refs=True)`)."""

    version: int
    buckets: list[Any] = field(default_factory=list)
    shared: Any = None  # a data.shared_weights.SharedWeights (export_weights(shared=True)) instead of buckets

    @property
    def num_bytes(self) -> int:
        """Bytes of the buckets held here (refs are not fetched and count 0)."""
        return sum(t.numel() * t.element_size() for b in self.buckets if isinstance(b, list) for _, t in b)


class WeightExporter:
    """One rank's exports; rank 0's shared-memory file (made at the first shared export) lives here until close."""

    def __init__(self, rank: int):
        self.rank = rank
        self.writer = None  # data.shared_weights.SharedWeightWriter, rank 0 only, on first use

    def export(self, source: Iterable[list], version: int, bucket_mb: float, as_refs: bool = False,
               shared: bool = False) -> WeightExport:
        """`source`'s buckets as a WeightExport of `version` (see TrainerWorker.export_weights for the modes)."""
        buckets = []
        if shared:  # rank 0 writes every tensor once into its file (an adapter push too); the others only gather
            tensors = (pair for bucket in source for pair in bucket)
            if self.rank != 0:
                for _ in tensors:
                    pass
                return WeightExport(version=version)
            if as_refs:  # engines on other nodes too: object-store buckets beside the file, from the same pass
                tensors = put_as_well(tensors, bucket_mb, buckets)
            record = self.shared_writer().write(tensors)
            record.fallback = buckets if as_refs else None
            return WeightExport(version=version, shared=record)
        for bucket in source:
            if self.rank == 0:
                # copies: the caller may hold them across later steps, which update the parameters in place
                copy = [(name, t.detach().to("cpu").clone().contiguous()) for name, t in bucket]
                if as_refs:
                    import ray  # only inside an actor; the class itself stays importable without a cluster

                    buckets.append(ray.put(copy))
                else:
                    buckets.append(copy)
        return WeightExport(version=version, buckets=buckets)

    def shared_writer(self):
        """This rank's shared-memory weight file, made on first use."""
        from gspo_ray.data.shared_weights import SharedWeightWriter

        if self.writer is None:
            self.writer = SharedWeightWriter(f"gspo-weights-rank{self.rank}")
        return self.writer

    def close(self) -> None:
        """Close the shared weight file, if one was made (it goes with its last mapping)."""
        if self.writer is not None:
            self.writer.close()


def put_as_well(tensors: Iterable, bucket_mb: float, refs: list) -> Iterator:
    """Pass `tensors` through while putting copies of them, in buckets of <= bucket_mb MiB, into the object
    store (their refs appended to `refs`)."""
    import ray

    bucket, size = [], 0
    for name, t in tensors:
        bucket.append((name, t.detach().to("cpu").clone().contiguous()))
        size += t.numel() * t.element_size()
        if size >= bucket_mb * 2 ** 20:
            refs.append(ray.put(bucket))
            bucket, size = [], 0
        yield name, t
    if bucket:
        refs.append(ray.put(bucket))
