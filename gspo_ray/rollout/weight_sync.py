"""Weight push into a live engine: buckets of (HF name, full tensor), streamed, then a probe check.

    buckets = iter_buckets(trainer_named_tensors, bucket_mb=64)    # trainer side (lazy generator)
    stats = push_buckets(engine, buckets)                          # rollout side: bounded memory
    diff = verify_probe(engine, probe)                             # teacher-forced log-probs vs the trainer's

A bucket is a list of (HF parameter name, unsharded tensor) of at most `bucket_mb` MiB (a single larger tensor
gets a bucket of its own). Buckets may also be `ray.ObjectRef`s: they are fetched one at a time while the engine
loads, so at most one bucket plus one partly loaded layer is held at once (vLLM buffers a layer's tensors until
the whole layer has arrived, then processes it). Names are the checkpoint's (HF) names, e.g.
`model.layers.0.mlp.experts.3.up_proj.weight`; any dtype (cast on copy).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

Bucket = list[tuple[str, torch.Tensor]]
MiB = 1024 * 1024


class WeightSyncError(RuntimeError):
    """A push left the engine disagreeing with the trainer (probe log-probs beyond tolerance)."""


@dataclass
class WeightProbe:
    """A probe sequence and the trainer's teacher-forced log-probs of token_ids[1:] under the pushed weights."""

    token_ids: list[int]
    logprobs: list[float]  # [len(token_ids) - 1]

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.token_ids) - 1:
            raise ValueError(f"probe: {len(self.logprobs)} log-probs for {len(self.token_ids)} tokens "
                             "(need one per token after the first)")


@dataclass
class PushStats:
    num_buckets: int = 0
    num_tensors: int = 0
    nbytes: int = 0
    seconds: float = 0.0

    def metrics(self) -> dict[str, float]:
        return {"sync/push_s": self.seconds, "sync/push_mb": self.nbytes / MiB,
                "sync/num_buckets": float(self.num_buckets), "sync/num_tensors": float(self.num_tensors)}


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_mb: float) -> Iterator[Bucket]:
    """Group (name, tensor) pairs, in order, into lists of at most `bucket_mb` MiB each."""
    limit = bucket_mb * MiB
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _resolve(bucket: Any) -> Bucket:
    """A bucket as given, or fetched when it is a Ray object reference."""
    if type(bucket).__name__ == "ObjectRef":
        import ray

        return ray.get(bucket)
    return bucket


def flatten_buckets(buckets: Iterable[Any], stats: PushStats) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the (name, tensor) pairs of each bucket in turn, counting buckets/tensors/bytes into `stats`."""
    for ref in buckets:
        bucket = _resolve(ref)
        stats.num_buckets += 1
        for name, tensor in bucket:
            stats.num_tensors += 1
            stats.nbytes += tensor.numel() * tensor.element_size()
            yield name, tensor
        del bucket  # release it before fetching the next one


def push_buckets(engine, buckets: Iterable[Any]) -> PushStats:
    """Stream buckets into `engine.load_weights` (a `RolloutEngine`); returns counts and wall time."""
    stats = PushStats()
    start = time.perf_counter()
    engine.load_weights(flatten_buckets(buckets, stats))
    stats.seconds = time.perf_counter() - start
    if stats.num_tensors == 0:
        raise WeightSyncError("weight push received no tensors")
    return stats


def verify_probe(engine, probe: WeightProbe, tol: float | None = None) -> float:
    """max |engine log-prob - probe log-prob| over the probe; raises WeightSyncError above `tol` (if given)."""
    got = torch.tensor(engine.prompt_logprobs(probe.token_ids), dtype=torch.float64)
    diff = float((got - torch.tensor(probe.logprobs, dtype=torch.float64)).abs().max())
    if tol is not None and not diff <= tol:  # `not <=` also catches NaN
        raise WeightSyncError(f"engine log-probs differ from the trainer's by {diff:.3g} > verify_tol {tol:g} "
                              "after a weight push")
    return diff


def build_probe_ids(vocab_size: int, length: int = 32, seed: int = 0, bos_id: int | None = None) -> list[int]:
    """A fixed pseudo-random token sequence for probing (same arguments -> same ids)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (length,), generator=gen).tolist()
    return ([bos_id] + ids[1:]) if bos_id is not None else ids


def read_checkpoint_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of an HF checkpoint's safetensors files, in file order (e.g. to reset an engine)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@torch.no_grad()
def hf_teacher_forced_logprobs(model: torch.nn.Module, sequences: list[list[int]]) -> list[list[float]]:
    """log p(seq[t] | seq[:t]) for t >= 1 under an HF causal LM, one unpadded forward per sequence.

    The reference side of a probe (or of a test) when the trainer's model is an HF model: [len(seq) - 1] each.
    """
    out = []
    for seq in sequences:
        ids = torch.tensor([seq])
        logits = model(input_ids=ids).logits.float()[0, :-1]  # [T-1, V]: position t predicts token t+1
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        out.append(logp.tolist())
    return out
