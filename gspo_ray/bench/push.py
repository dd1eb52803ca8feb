"""`gspo-ray bench --suite push`: the SmolLM2 weight push, object store against shared memory, interleaved.

    gspo-ray bench --suite push [--steps 5]

One rollout actor (the smollm2 recipe's engine, built as the job builds it) and one exporter actor standing in for
trainer rank 0: it holds the checkpoint's 513 MB of fp32 tensors and exports them the way the trainer does, either
as object-store buckets (`trainer.export_shared_memory: false`: a contiguous copy of each bucket, `ray.put`) or into
its shared-memory file (`SharedWeightWriter`, the default on one node). The trainer's gather of its own parameters
(`export_hf_weights`) comes before both and is not timed. Each round pushes both ways, the order alternating, through
`RolloutPool.push_weights` (what the job calls); printed per way: the median and range over the rounds of the export
(in the exporter), the push (driver wall time, the engine's fetch and vLLM reload included) and their sum, with the
machine's load average at the start and end.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

WAYS = ("object store", "shared memory")


class Exporter:
    """Trainer rank 0's export of a fixed set of tensors, both ways (runs as a Ray actor)."""

    def __init__(self, model_dir: str, bucket_mb: float):
        from gspo_ray.data.shared_weights import SharedWeightWriter
        from gspo_ray.rollout.weight_sync import read_checkpoint_weights

        self.weights = list(read_checkpoint_weights(model_dir))
        self.bucket_mb = bucket_mb
        self.writer = SharedWeightWriter()

    def export(self, way: str):
        """(export seconds, what the pool pushes)."""
        import ray

        from gspo_ray.rollout.weight_sync import iter_buckets

        t0 = time.perf_counter()
        if way == "shared memory":
            out = self.writer.write(self.weights)
        else:  # as TrainerWorker.export_weights(as_refs=True)
            out = [ray.put([(n, t.detach().clone().contiguous()) for n, t in bucket])
                   for bucket in iter_buckets(self.weights, self.bucket_mb)]
        return time.perf_counter() - t0, out


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def run_push_bench(rounds: int = 5, model_dir: Path = Path("runs/models/smollm2-135m-instruct")) -> str:
    import ray

    from gspo_ray.bench.common import SMOLLM2_RECIPE
    from gspo_ray.config import load_config
    from gspo_ray.coordinator.pools import build_rollout_pool
    from gspo_ray.models.gguf import ensure_imported

    ensure_imported(model_dir)
    cfg = load_config(SMOLLM2_RECIPE, [f"model.path={model_dir}", "model.packaged=null"])
    load_start = os.getloadavg()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False)
    try:
        with tempfile.TemporaryDirectory(prefix="gspo-bench-push-") as tmp:
            pool = build_rollout_pool(cfg, model_dir, Path(tmp))
            exporter = ray.remote(Exporter).options(num_cpus=0).remote(str(model_dir), cfg.trainer.export_bucket_mb)
            times = {w: {"export": [], "push": [], "sync": []} for w in WAYS}
            mb = 0.0
            for r in range(rounds + 1):  # round 0 warms both ways up (page faults of new buffers, first reload)
                for way in (WAYS if r % 2 else WAYS[::-1]):
                    t0 = time.perf_counter()
                    export_s, payload = ray.get(exporter.export.remote(way))
                    m = pool.push_weights(r, payload)
                    if r:
                        times[way]["export"].append(export_s)
                        times[way]["push"].append(m["sync/push_s"])
                        times[way]["sync"].append(time.perf_counter() - t0)
                    mb = m.get("sync/push_mb", mb)
                    del payload
            pool.shutdown()
    finally:
        ray.shutdown()
    load_end = os.getloadavg()
    lines = [f"SmolLM2-135M weight push, {mb:.0f} MiB fp32, {rounds} rounds after a warm-up, ways alternating; "
             f"median (range) s; load average {load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end",
             "| way | export s | push s | export + push s | GB/s (export + push) |", "|---|---|---|---|---|"]
    for way in WAYS:
        t = times[way]
        rate = mb * 2 ** 20 / statistics.median(t["sync"]) / 1e9
        lines.append(f"| {way} | {_spread(t['export'])} | {_spread(t['push'])} | {_spread(t['sync'])} | {rate:.2f} |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def run_tp_push_bench(rounds: int = 5, root: Path | None = None) -> str:
    """Shared-memory pushes through vLLM's weight-transfer protocol into a TP 1 (in-process) and a TP 2
    (multi-process, a core per worker) engine of one dense Qwen2 (hidden 512, 8 heads, 8 layers: SmolLM2's 9 heads
    do not split in two), one engine at a time, no Ray; median (range) of `rounds` pushes after a warm-up, each
    push the file written by this process (the trainer's export) and mapped by every worker of the engine."""
    from gspo_ray.data.shared_weights import SharedWeightWriter
    from gspo_ray.models.tiny import make_tiny_model
    from gspo_ray.rollout.engine import RolloutEngine
    from gspo_ray.rollout.weight_sync import push_buckets, read_checkpoint_weights

    with tempfile.TemporaryDirectory(prefix="gspo-bench-tp-push-") as tmp:
        base = Path(root or tmp)
        model = make_tiny_model("qwen2", base / "model", seed=0, hidden=512, layers=8, heads=8)
        weights = list(read_checkpoint_weights(model))
        mb = sum(t.numel() * t.element_size() for _, t in weights) / 2 ** 20
        writer = SharedWeightWriter()
        lines = [f"Qwen2 hidden 512 x 8 layers, {mb:.0f} MiB fp32: shared-memory push through gspo_shm, {rounds} "
                 f"rounds after a warm-up; median (range) s; load average {os.getloadavg()[0]:.1f} at the start",
                 "| engine | start s | push s |", "|---|---|---|"]
        for tp in (1, 2):
            t0 = time.perf_counter()
            engine = RolloutEngine(model, run_dir=base / f"tp{tp}", max_model_len=128, kv_cache_gb=0.125,
                                   cpu_cores="0-1" if tp == 2 else "0", tensor_parallel_size=tp)
            start_s = time.perf_counter() - t0
            pushes = []
            for r in range(rounds + 1):
                shared = writer.write(weights)
                t0 = time.perf_counter()
                push_buckets(engine, shared)
                if r:
                    pushes.append(time.perf_counter() - t0)
            engine.shutdown()
            lines.append(f"| TP {tp} ({engine.mode}) | {start_s:.1f} | {_spread(pushes)} |")
        writer.close()
    text = "\n".join(lines)
    print(text, flush=True)
    return text
