"""Run a function on N fresh processes that form one torch.distributed group (for multi-rank tests without Ray).

    results = run_ranks(scenario, world_size=2, args=(model_dir, tmp_path))   # [rank0_result, rank1_result]

`scenario(rank, world_size, ports, *args)` must be importable (module level); `ports` holds `n_ports` free ports
(one per process group the scenario builds in turn); its return value comes back through a file (torch.save), so
tensors and nested dicts are fine. A failing rank's traceback is raised here.

Ranks are forked from a fork server (one per test session) that has imported torch, megatron-core (through the
guarded import) and the trainer once: a spawned rank spent ~7 s of CPU importing them, on each of ~40 calls. The
server is a fresh interpreter, not the pytest process, so no engine, thread pool or process group of a test leaks
into a rank; each rank gets the caller's environment as it is at the call.
"""
from __future__ import annotations

import os
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from gspo_ray.trainer.parallel import free_port


# what every rank imports, in this order (the guarded megatron import first: megatron without torch.compile)
PRELOAD = ["torch", "gspo_ray.compat.megatron_import", "gspo_ray.trainer.worker", "gspo_ray.trainer.weights.bridge"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server first starts
    return ctx


def _entry(rank: int, fn, world_size: int, ports: list[int], out_dir: str, args: tuple, environ: dict) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the caller's, not the fork server's (started by an earlier test)
    torch.set_num_threads(1)  # two ranks share two cores: more threads per rank only contend
    out = Path(out_dir) / f"rank_{rank}.pt"
    try:
        torch.save({"ok": fn(rank, world_size, ports, *args)}, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise


def run_ranks(fn, world_size: int, args: tuple = (), n_ports: int = 1, timeout_s: float = 600) -> list:
    """Start `world_size` spawned processes running fn; return their results in rank order."""
    ports: list[int] = []
    for _ in range(n_ports):  # distinct: each process group in turn gets its own store port
        ports.append(free_port(exclude=set(ports)))
    ctx = _context()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_entry, args=(r, fn, world_size, ports, out_dir, args, dict(os.environ)),
                             daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        # a rank that fails leaves the others waiting in a collective: stop them at once instead of at the timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
        for p in procs:  # only our own children, by handle
            if p.is_alive():
                p.kill()
                p.join()
        paths = [Path(out_dir) / f"rank_{r}.pt" for r in range(world_size)]
        results = [torch.load(p, weights_only=False) if p.exists() else None for p in paths]
    errors = [f"rank {r} failed:\n{res['error']}" for r, res in enumerate(results) if res and "error" in res]
    if errors:  # every failing rank's traceback (a peer of the culprit often fails too, with a vaguer message)
        raise RuntimeError("\n".join(errors))
    for r, res in enumerate(results):
        if res is None:
            raise RuntimeError(f"rank {r} produced no result (exit code {procs[r].exitcode}; timeout or crash)")
    return [res["ok"] for res in results]



# ---- shared pieces of the trainer tests ----------------------------------------------------------------------------
def make_batch(num_seqs: int = 8, seed: int = 0, vocab: int = 22):
    """A TrainBatch of random prompts/completions of varied lengths (tokens 3..vocab-1), advantages +1,-1,+.5,-.5..;
    old_logp is left 0 (the scenarios set it from the policy)."""
    from gspo_ray.data.records import Sample, collate

    g = torch.Generator().manual_seed(seed)
    samples, advs = [], []
    for i in range(num_seqs):
        p = int(torch.randint(3, 7, (1,), generator=g))
        c = int(torch.randint(2, 10, (1,), generator=g))
        ids = torch.randint(3, vocab, (p + c,), generator=g).tolist()
        samples.append(Sample(prompt_uid=f"p{i // 4}", sample_index=i % 4, prompt_ids=ids[:p], completion_ids=ids[p:],
                              logprobs=[0.0] * c, loss_mask=[1] * c, versions=[0] * c, finish_reason="stop"))
        advs.append([(1.0 if i % 2 == 0 else -1.0) * (1.0 if (i // 2) % 2 == 0 else 0.5)] * c)
    return collate(samples, advs)


# per-row shift of old_logp: log s = -delta. Row 1 (A<0, s<1-eps_low) and row 2 (A>0, s>1+eps_high) are clipped,
# row 3 (A<0, s>1) is not; the rest sit inside the band (tiny token noise keeps the mismatch metrics non-zero).
OLD_LOGP_SHIFT = (0.0, 0.01, -0.01, -0.01, 0.0, 0.0, 0.0, 0.0)


def with_old_logp(batch, logp: torch.Tensor, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    shift = torch.tensor([OLD_LOGP_SHIFT[i % len(OLD_LOGP_SHIFT)] for i in range(batch.num_sequences)])[:, None]
    noise = 1e-5 * torch.randn(logp.shape, generator=g)
    batch.old_logp = torch.where(batch.loss_mask.bool(), logp + shift + noise, 0.0)
    return batch


def trainer_cfg(world_size: int = 1, **kw):
    from gspo_ray.config import TrainerConfig

    base = dict(num_workers=world_size, lr=1e-2, micro_batch_size=4, grad_clip=1.0, router_churn_every=1, seed=0)
    return TrainerConfig(**(base | kw))


def algo_cfg(**kw):
    from gspo_ray.config import AlgorithmConfig

    return AlgorithmConfig(**kw)
