"""Weight push into a live engine: buckets of (HF name, full tensor), streamed, then a probe check.

    buckets = iter_buckets(trainer_named_tensors, bucket_mb=64)    # trainer side (lazy generator)
    stats = push_buckets(engine, buckets)                          # rollout side: bounded memory
    metrics = verify_probe(engine, probe, tol=1e-4, count_experts=True)  # teacher-forced log-probs vs trainer's
    names = checkpoint_tensor_names(model_dir)                     # what a complete push holds (engine.py checks)

A bucket is a list of (HF parameter name, unsharded tensor) of at most `bucket_mb` MiB (a single larger tensor
gets a bucket of its own). Buckets may also be `ray.ObjectRef`s: they are fetched one at a time while the engine
loads, so at most one bucket plus one partly loaded layer is held at once (vLLM buffers a layer's tensors until
the whole layer has arrived, then processes it). Names are the checkpoint's (HF) names, e.g.
`model.layers.0.mlp.experts.3.up_proj.weight`; any dtype (cast on copy).

On one node the push goes through shared memory instead: the trainer writes every tensor once into a memfd
(`SharedWeightWriter`, one copy, no pickling) and sends only a `SharedWeights` record (names, dtypes, shapes,
offsets, its pid and fd); the engine maps that file through `/proc/<pid>/fd/<fd>` and loads straight from the
mapping (`read_shared`). An engine on another node (`push_route` by Ray node id) takes the object-store buckets
the record carries as `fallback`.
"""
from __future__ import annotations

import json
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from gspo_ray.data.shared_weights import SharedWeights, SharedWeightsError, current_node_id, read_shared

Bucket = list[tuple[str, torch.Tensor]]
log = logging.getLogger(__name__)
MiB = 1024 * 1024


class WeightSyncError(RuntimeError):
    """A push left the engine disagreeing with the trainer (probe log-probs beyond tolerance)."""


@dataclass
class WeightProbe:
    """Probe sequences and the trainer's teacher-forced log-probs (temperature 1) of each one's tokens after the
    first, under the pushed weights. Several sequences: enough tokens to reach every expert of a large MoE."""

    sequences: list[list[int]]
    logprobs: list[list[float]]  # [len(sequences[i]) - 1] each

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.sequences) or not self.sequences:
            raise ValueError(f"probe: {len(self.logprobs)} log-prob rows for {len(self.sequences)} sequences")
        for ids, lp in zip(self.sequences, self.logprobs):
            if len(lp) != len(ids) - 1:
                raise ValueError(f"probe: {len(lp)} log-probs for {len(ids)} tokens "
                                 "(need one per token after the first)")

    @classmethod
    def single(cls, token_ids: list[int], logprobs: list[float]) -> "WeightProbe":
        return cls([list(token_ids)], [list(logprobs)])


@dataclass
class PushStats:
    num_buckets: int = 0
    num_tensors: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    engine: dict[str, float] = field(default_factory=dict)  # the engine's own `sync/*` split (adapter pushes)

    def metrics(self) -> dict[str, float]:
        """`sync/push_s` here: fetching the buckets and loading them into the engine (the check not included)."""
        return {"sync/push_s": self.seconds, "sync/push_mb": self.nbytes / MiB,
                "sync/num_buckets": float(self.num_buckets), "sync/num_tensors": float(self.num_tensors)
                } | self.engine


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


def push_route(exporter_node: str, engine_node: str, has_fallback: bool) -> str:
    """How an engine receives a shared export: "shared" (same node: map the trainer's file), "object_store" (another
    node: the fallback buckets). Raises WeightSyncError for another node without fallback buckets."""
    if exporter_node and exporter_node == engine_node:
        return "shared"
    if not has_fallback:
        raise WeightSyncError(f"weight push from node {exporter_node} to an engine on node {engine_node} has no "
                              "object-store buckets (a shared-memory export reaches one node only)")
    return "object_store"


def _resolve(bucket: Any) -> Bucket:
    """A bucket as given, or fetched when it is a Ray object reference."""
    if type(bucket).__name__ == "ObjectRef":
        import ray

        return ray.get(bucket)
    return bucket


def flatten_buckets(buckets: Iterable[Any], stats: PushStats) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the (name, tensor) pairs of each bucket in turn, counting buckets/tensors/bytes into `stats`.
    `buckets` may be a SharedWeights: mapped on the exporter's node, its fallback buckets elsewhere."""
    if isinstance(buckets, SharedWeights):
        if push_route(buckets.node_id, current_node_id(), buckets.fallback is not None) == "shared":
            stats.num_buckets += 1
            try:
                for name, tensor in read_shared(buckets):
                    stats.num_tensors += 1
                    stats.nbytes += tensor.numel() * tensor.element_size()
                    yield name, tensor
            except SharedWeightsError as e:
                raise WeightSyncError(str(e)) from e
            return
        buckets = buckets.fallback
    for ref in buckets:
        bucket = _resolve(ref)
        stats.num_buckets += 1
        for name, tensor in bucket:
            stats.num_tensors += 1
            stats.nbytes += tensor.numel() * tensor.element_size()
            yield name, tensor
        del bucket  # release it before fetching the next one


def push_buckets(engine, buckets: Iterable[Any]) -> PushStats:
    """Stream buckets into `engine.load_weights` (a `RolloutEngine`); returns counts and wall time. A shared
    export written on this node goes to `engine.push_shared` whole: each of the engine's workers maps it."""
    stats = PushStats()
    start = time.perf_counter()
    if isinstance(buckets, SharedWeights) and push_route(buckets.node_id, current_node_id(),
                                                         buckets.fallback is not None) == "shared":
        stats.num_buckets, stats.num_tensors = 1, len(buckets.entries)
        stats.nbytes = sum(math.prod(shape) * getattr(torch, dtype).itemsize
                           for _, dtype, shape, _ in buckets.entries)
        loaded = engine.push_shared(buckets)  # a stale or unreadable file raises in the workers: WeightSyncError
    else:
        loaded = engine.load_weights(flatten_buckets(buckets, stats))
    stats.seconds = time.perf_counter() - start
    stats.engine = {k: float(v) for k, v in (loaded or {}).items() if k.startswith("sync/")}
    if stats.num_tensors == 0:
        raise WeightSyncError("weight push received no tensors")
    return stats


# Default probe tolerance by engine dtype: (statistic, tol). fp32: per-token max |engine - trainer| (measured
# ~5e-7 on the tiny models, 6e-5 on SmolLM2); a corrupt expert moves it by ~0.06. bf16: the mean over the probe's
# tokens, because single tokens jump where a near-tied router flips (up to ~1-4 per token); measured here
# mean 1e-3 (tiny MoE, bf16 engine vs fp32 trainer), up to ~0.1 elsewhere, so 0.2 passes bf16 rounding and
# catches gross errors (stale packed weights, half-loaded layers). Subtle corruption needs an fp32 engine.
VERIFY_TOL = {"float32": ("max", 1e-4), "bfloat16": ("mean", 0.2)}


def verify_probe(engine, probe: WeightProbe, tol: float | None = None, statistic: str = "max",
                 count_experts: bool = False) -> dict[str, float]:
    """Teacher-forced engine log-probs vs the probe's: `sync/verify_max_abs_diff`, `sync/verify_mean_abs_diff`
    and, with count_experts, the probe's expert coverage (`sync/probe_expert_coverage`, ...). Raises
    WeightSyncError when the `statistic` ("max" | "mean") exceeds `tol` (if given)."""
    from gspo_ray.rollout.expert_coverage import coverage_report

    got, counts = engine.probe_logprobs(probe.sequences, count_experts=count_experts)
    diff = torch.cat([(torch.tensor(g, dtype=torch.float64) - torch.tensor(r, dtype=torch.float64)).abs()
                      for g, r in zip(got, probe.logprobs)])
    metrics = {"sync/verify_max_abs_diff": float(diff.max()), "sync/verify_mean_abs_diff": float(diff.mean())}
    value = metrics[f"sync/verify_{statistic}_abs_diff"]
    if tol is not None and not value <= tol:  # `not <=` also catches NaN
        raise WeightSyncError(f"engine log-probs differ from the trainer's by {value:.3g} ({statistic} over the "
                              f"probe) > verify_tol {tol:g} after a weight push")
    cover, missed = coverage_report(counts)
    if missed:
        log.warning("weight-push probe reached no token in %d (layer, expert) pairs, e.g. %s: those experts are "
                    "not verified", len(missed), missed[:3])
    return metrics | cover


_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>[a-z0-9_]+?)(?P<kind>\.weight|_bias|\.bias)?$")


def checkpoint_tensor_names(model_dir: str | Path) -> set[str]:
    """Tensor names in a checkpoint's safetensors files (headers only), fused experts named per expert
    (`expert_names`); empty if there are none. Without the multi-token-prediction layers of a GLM-4.5 /
    DeepSeek-V3 checkpoint (models/mtp.py): vLLM's sampler skips them on load and the trainer never pushes them."""
    from safetensors import safe_open

    from gspo_ray.models.mtp import is_mtp_tensor

    config_path = Path(model_dir) / "config.json"
    cfg = json.loads(config_path.read_text()) if config_path.is_file() else {}
    names: set[str] = set()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if not is_mtp_tensor(cfg, name):
                    names.update(expert_names(name, tuple(f.get_slice(name).get_shape())))
    return names


def expert_names(name: str, shape: tuple[int, ...]) -> list[str]:
    """A checkpoint tensor's name(s) in per-expert form, so fused and per-expert checkpoints compare equal.

    Fused experts hold every expert in one tensor whose first dimension is the expert:
    `mlp.experts.gate_up_proj` [E, ...] -> `mlp.experts.{e}.gate_proj.weight` and `...{e}.up_proj.weight`,
    `mlp.experts.down_proj_bias` [E, ...] -> `mlp.experts.{e}.down_proj.bias`. Any other name is returned as is.
    """
    m = _FUSED_EXPERTS.match(name)
    if m is None or len(shape) < 2:  # per-expert names carry an index (`experts.3.up_proj.weight`): no match
        return [name]
    kind = ".weight" if m["kind"] in (None, ".weight") else ".bias"
    projs = ("gate_proj", "up_proj") if m["proj"] == "gate_up_proj" else (m["proj"],)
    return [f"{m['prefix']}.{e}.{proj}{kind}" for e in range(shape[0]) for proj in projs]


def build_probe_ids(vocab_size: int, length: int = 32, seed: int = 0, bos_id: int | None = None) -> list[int]:
    """A fixed pseudo-random token sequence for probing (same arguments -> same ids)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (length,), generator=gen).tolist()
    return ([bos_id] + ids[1:]) if bos_id is not None else ids


def probe_tokens_needed(num_experts: int, top_k: int, num_layers: int, miss: float = 0.01, margin: int = 4) -> int:
    """`margin` x the tokens after which, were routing uniform, P(some (layer, expert) pair gets no token) <=
    `miss` (num_layers * E * (1 - k/E)^n <= miss). Real routers are uneven: hence the margin, and the probe
    reports its coverage (router counts) at every push."""
    if num_experts <= top_k:
        return 32
    uniform = math.log(miss / (num_layers * num_experts)) / math.log(1 - top_k / num_experts)
    return max(32, math.ceil(margin * uniform))


def build_probe_sequences(vocab_size: int, max_len: int, model_config: dict | None = None, seed: int = 0,
                          max_sequences: int = 8) -> list[list[int]]:
    """Pseudo-random probe sequences of at most `max_len` tokens: one of 32 for a dense model; for an MoE
    (`num_experts`/`num_local_experts`/`n_routed_experts` and `num_experts_per_tok` in model_config, the HF
    config.json) as many full-length ones as `probe_tokens_needed` asks (at most max_sequences)."""
    cfg = model_config or {}
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    top_k = cfg.get("num_experts_per_tok") or 1
    if experts <= 1:
        return [build_probe_ids(vocab_size, min(32, max_len), seed)]
    need = probe_tokens_needed(experts, top_k, cfg.get("num_hidden_layers", 1))
    count = min(max_sequences, math.ceil(need / max_len))
    length = min(max_len, max(32, math.ceil(need / count)))
    return [build_probe_ids(vocab_size, length, seed + i) for i in range(count)]


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
