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
