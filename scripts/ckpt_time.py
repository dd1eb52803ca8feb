"""Time a trainer checkpoint save and resume of SmolLM2-135M at DP 2 (two gloo ranks, fp32), for any checkout.

    flock /tmp/gspo-heavy.lock env PYTHONPATH=<checkout> .venv/bin/python scripts/ckpt_time.py MODEL_DIR OUT_DIR

Each rank: build the trainer, one train step (so the optimizer has state), save (timed), a fresh trainer, load
(timed). Prints rank 0's seconds and the checkpoint's bytes on disk. The optimizer is whatever the checkout's
default is at DP 2. Uses the checkout's tests/trainer/_spawn.py (importable from PYTHONPATH's tests/trainer).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(os.environ.get("PYTHONPATH", ".").split(":")[0]) / "tests" / "trainer"))
from _spawn import algo_cfg, make_batch, run_ranks, trainer_cfg  # noqa: E402


def _scenario(rank, world_size, ports, model_dir, out_dir):
    import torch.distributed as dist

    from gspo_ray.trainer.worker import TrainerWorker

    cfg = trainer_cfg(2, micro_batch_size=4, lr=1e-5)
    batch = make_batch(8, seed=1)
    w = TrainerWorker(rank, world_size, "127.0.0.1", ports[0], model_dir, cfg, algo_cfg())
    batch.old_logp = w.compute_logprobs(batch)
    w.train_step(batch)
    dist.barrier()
    t0 = time.perf_counter()
    w.save(out_dir)
    save_s = time.perf_counter() - t0
    w.shutdown()
    w = TrainerWorker(rank, world_size, "127.0.0.1", ports[1], model_dir, cfg, algo_cfg())
    dist.barrier()
    t0 = time.perf_counter()
    w.load(out_dir)
    load_s = time.perf_counter() - t0
    w.shutdown()
    return {"save_s": save_s, "load_s": load_s}


if __name__ == "__main__":
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    res = run_ranks(_scenario, 2, (model_dir, out_dir), n_ports=2)
    size = sum(p.stat().st_size for p in Path(out_dir).iterdir())
    print(json.dumps({"save_s": [r["save_s"] for r in res], "load_s": [r["load_s"] for r in res],
                      "bytes": size, "files": sorted(p.name for p in Path(out_dir).iterdir())}))
