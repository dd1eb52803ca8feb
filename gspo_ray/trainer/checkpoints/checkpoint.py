"""Trainer checkpoints: one `rank_{r}.pt` per rank plus `meta.json`, written last (its presence = complete).

    save_checkpoint(ckpt_dir, rank, payload, meta)        # every rank; rank 0 writes meta.json after a barrier
    payload = load_rank_payload(ckpt_dir, rank)
    model_sd = load_model_state(ckpt_dir, layout)         # model only, from any DP size with the same tp/ep

A rank's payload holds `model` (its Megatron state dict shard), `optimizer` (see `optimizer_state`), `scheduler`,
`version`, `rng` and `layout` (tp/ep/etp/pp ranks). Model shards depend only on the tp rank (dense params) and
the ep/etp rank (expert params), so `load_model_state` can assemble a rank's model from a checkpoint written with a
different data-parallel size; optimizer state needs the same layout (resharding it is not implemented).

Loading never unpickles code: payloads hold only tensors and plain Python values (RNG states are stored as tensors
and numbers), so `torch.load(weights_only=True)` reads them, and a rank file must be a regular file inside the
checkpoint directory (a symlink out of it is refused). The checkpoint volume is writable by pods that run user code.

Integrity without reading back: each rank hashes its file while torch.save writes it; rank 0 records every rank
file's size and sha256 in meta.json (`files`), and the job's manifest takes them from there. A rank that loads a
file checks it against that record first (its size, then its sha256: one sequential read, which also leaves the
file in the page cache for torch.load), so a truncated or altered file is a CorruptCheckpointError naming it.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from gspo_ray.trainer.checkpoints.durable import HashingWriter, fsync_dir, sha256_file, write_durable
from gspo_ray.trainer.optim import sub_optimizers
from gspo_ray.trainer.checkpoints.safe_paths import META, UnsafeCheckpointError, check_inside

EXPERT_KEY = ".experts."  # Megatron names of expert-parallel params contain this


class CorruptCheckpointError(ValueError):
    """A rank file that torch cannot read (truncated, or not a checkpoint): named, never a bare EOFError."""


def rank_file(ckpt_dir: str | Path, rank: int) -> Path:
    return Path(ckpt_dir) / f"rank_{rank}.pt"


# ---- RNG -----------------------------------------------------------------------------------------------------------
def capture_rng_state() -> dict:
    """torch (CPU, and CUDA when present), numpy, python, and Megatron's model-parallel RNG tracker states, as
    tensors and plain numbers only (loadable with `weights_only=True`)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "torch": torch.get_rng_state(),
        "numpy": numpy_rng_to_tensors(np.random.get_state()),
        "python": python_rng_to_tensors(random.getstate()),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    np.random.set_state(numpy_rng_from_tensors(state["numpy"]))
    random.setstate(python_rng_from_tensors(state["python"]))
    get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def numpy_rng_to_tensors(np_state: tuple) -> dict:
    """np.random.get_state() = ('MT19937', uint32[624] keys, pos, has_gauss, cached_gaussian) -> tensors/numbers."""
    name, keys, pos, has_gauss, cached = np_state
    return {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def numpy_rng_from_tensors(d: dict) -> tuple:
    return d["name"], d["keys"].numpy().astype(np.uint32), d["pos"], d["has_gauss"], d["cached_gaussian"]


def python_rng_to_tensors(py_state: tuple) -> dict:
    """random.getstate() = (version, 625 ints < 2**32, gauss_next or None) -> an int64 tensor and numbers."""
    version, internal, gauss_next = py_state
    return {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next}


def python_rng_from_tensors(d: dict) -> tuple:
    return d["version"], tuple(int(x) for x in d["state"].tolist()), d["gauss_next"]


# ---- optimizer -----------------------------------------------------------------------------------------------------
def optimizer_state(optimizer) -> list[dict]:
    """Per sub-optimizer: the inner torch optimizer's state (exp_avg, exp_avg_sq, step, hyper-parameters) and the
    parameters it updates (fp32 main params: copies for bf16, this rank's shards for the distributed optimizer).

    The same layout on load restores it exactly, whatever Megatron optimizer class holds it.
    """
    out = []
    for sub in sub_optimizers(optimizer):
        inner = sub.optimizer
        out.append({
            "inner": inner.state_dict(),
            "main_params": [p.detach().clone() for g in inner.param_groups for p in g["params"]],
            "grad_scaler": sub.grad_scaler.state_dict() if getattr(sub, "grad_scaler", None) else None,
        })
    return out


@torch.no_grad()
def load_optimizer_state(optimizer, state: list[dict]) -> None:
    subs = sub_optimizers(optimizer)
    if len(subs) != len(state):
        raise ValueError(f"checkpoint has {len(state)} sub-optimizers, this model has {len(subs)}")
    for i, (sub, saved) in enumerate(zip(subs, state)):
        inner = sub.optimizer
        params = [p for g in inner.param_groups for p in g["params"]]
        if len(params) != len(saved["main_params"]):
            raise ValueError(f"sub-optimizer {i}: {len(saved['main_params'])} params saved, {len(params)} here")
        inner.load_state_dict(saved["inner"])
        for p, v in zip(params, saved["main_params"]):
            if p.shape != v.shape:
                raise ValueError(f"sub-optimizer {i}: param of shape {tuple(v.shape)} saved, {tuple(p.shape)} here")
            p.copy_(v)
        if saved["grad_scaler"] is not None and getattr(sub, "grad_scaler", None):
            sub.grad_scaler.load_state_dict(saved["grad_scaler"])


# ---- files ---------------------------------------------------------------------------------------------------------
def save_checkpoint(ckpt_dir: str | Path, rank: int, payload: dict, meta: dict) -> Path:
    """Write this rank's payload atomically and durably (fsync of the file, then of the directory after the
    rename); after all ranks are done, rank 0 writes meta.json the same way. Collective."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = rank_file(ckpt_dir, rank)
    tmp = path.with_suffix(".pt.tmp")
    try:
        with open(tmp, "wb") as f:
            writer = HashingWriter(f)  # the digest of what is written: nobody reads the file back to hash it
            torch.save(payload, writer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(ckpt_dir)
    except BaseException:
        tmp.unlink(missing_ok=True)  # no half-written rank file left behind (the job removes the directory too)
        raise
    digests = [writer.digest()]
    if dist.is_initialized():  # every rank's file is written once this returns
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, writer.digest())
    if rank == 0:
        files = {rank_file(ckpt_dir, r).name: d for r, d in enumerate(digests)}
        write_durable(ckpt_dir / META, json.dumps({**meta, "files": files}, indent=2))
    if dist.is_initialized():
        dist.barrier()  # nobody returns before the checkpoint is complete
    return ckpt_dir


def read_meta(ckpt_dir: str | Path) -> dict:
    path = Path(ckpt_dir) / META
    if not path.exists():
        raise FileNotFoundError(f"{ckpt_dir}: no {META}, not a complete trainer checkpoint")
    check_inside(path, ckpt_dir)
    return json.loads(path.read_text())


_checked: set[tuple[str, int, int]] = set()  # rank files this process verified: (path, size, mtime_ns)


def check_rank_file(ckpt_dir: str | Path, path: Path) -> None:
    """The size and sha256 meta.json recorded for `path` when it was written (none recorded: an older checkpoint,
    nothing to check); CorruptCheckpointError naming the file when they differ. Once per file and process."""
    meta_path = Path(ckpt_dir) / META
    if not meta_path.exists():
        return
    want = read_meta(ckpt_dir).get("files", {}).get(path.name)
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if want is None or key in _checked:
        return
    if st.st_size != want.get("size"):
        raise CorruptCheckpointError(f"{path}: truncated or corrupt ({st.st_size} bytes, {want.get('size')} when "
                                     "saved)")
    if sha256_file(path) != want.get("sha256"):
        raise CorruptCheckpointError(f"{path}: truncated or corrupt (its content differs from the sha256 recorded "
                                     "when saved)")
    _checked.add(key)


def load_rank_payload(ckpt_dir: str | Path, rank: int, mmap: bool = False) -> dict:
    """One rank's payload, read without unpickling (tensors and plain values only), after `check_rank_file`.
    mmap: tensors stay in the file's pages until used (a loader that needs slices of another rank's file)."""
    import pickle

    path = rank_file(ckpt_dir, rank)
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing rank file")
    check_inside(path, ckpt_dir)
    check_rank_file(ckpt_dir, path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        # an older checkpoint (numpy RNG state pickled) or a tampered file: never fall back to full unpickling
        raise UnsafeCheckpointError(f"{path}: refused to load, it holds objects other than tensors and plain values "
                                    f"({str(e).splitlines()[0]})") from None
    except (EOFError, RuntimeError) as e:  # torch: "Ran out of input", "PytorchStreamReader failed reading ..."
        raise CorruptCheckpointError(f"{path}: truncated or corrupt ({type(e).__name__}: "
                                     f"{(str(e).splitlines() or [''])[0]})") from None


def find_rank(meta: dict, **want: int) -> int:
    for r, lay in enumerate(meta["layouts"]):
        if all(lay[k] == v for k, v in want.items()):
            return r
    raise ValueError(f"checkpoint (world size {meta['world_size']}, tp {meta['tp']}, ep {meta['ep']}) has no rank "
                     f"with {want}")


def load_model_state(ckpt_dir: str | Path, layout: dict) -> dict:
    """This rank's model state dict, assembled from saved ranks with the same tp (dense) and ep/etp (experts).

    Works for a different data-parallel size; raises ValueError when tp or ep differ from the checkpoint's.
    """
    meta = read_meta(ckpt_dir)
    for key in ("tp", "ep"):
        if meta[key] != layout[key]:
            raise ValueError(f"checkpoint {ckpt_dir} was written with {key}={meta[key]}, this trainer has "
                             f"{key}={layout[key]}: model shards cannot be resharded on load")
    dense_src = find_rank(meta, tp_rank=layout["tp_rank"], pp_rank=layout["pp_rank"])
    expert_src = find_rank(meta, ep_rank=layout["ep_rank"], etp_rank=layout["etp_rank"], pp_rank=layout["pp_rank"])
    dense = load_rank_payload(ckpt_dir, dense_src)["model"]
    if expert_src == dense_src:
        return dense
    experts = load_rank_payload(ckpt_dir, expert_src)["model"]
    merged = {k: v for k, v in dense.items() if EXPERT_KEY not in k}
    merged.update({k: v for k, v in experts.items() if EXPERT_KEY in k})
    return merged


_COORDS = ("tp_rank", "ep_rank", "etp_rank", "pp_rank")


def state_source(meta: dict, layout: dict) -> int:
    """The saved rank whose scheduler position and RNG states this rank restores: its own number when that rank had
    the same TP/EP coordinates, else the first with them, else rank 0 (another TP/EP size)."""
    rank, layouts = layout["rank"], meta["layouts"]
    same = lambda lay: all(lay.get(k, 0) == layout.get(k, 0) for k in _COORDS)  # noqa: E731
    if rank < len(layouts) and same(layouts[rank]):
        return rank
    return next((r for r, lay in enumerate(layouts) if same(lay)), 0)


def legacy_was_distributed(ckpt_dir: str | Path) -> bool:
    """Whether a checkpoint of the older layout holds distributed-optimizer state (flat 1-D main-param shards)
    rather than a plain optimizer's (params in their own shapes). Reads rank 0's file memory-mapped."""
    subs = load_rank_payload(ckpt_dir, 0, mmap=True)["optimizer"]
    mains = [p for sub in subs for p in sub["main_params"]]
    return bool(mains) and all(p.dim() == 1 for p in mains)


def describe_layers(layers: dict) -> str:
    """A checkpoint's `layers` record ({"te": bool, "grouped_gemm": bool}) in words."""
    kind = "Transformer Engine layers" if layers.get("te") else "Megatron's local layers"
    return kind + (", grouped GEMM experts" if layers.get("grouped_gemm") else "")


def check_layers(meta: dict, layers: dict, where: str) -> None:
    """Whether a checkpoint written by other layers than this trainer builds can resume here; ValueError naming
    both, before anything is read, where it cannot.

    Maps (trainer/checkpoints/shards.py reads each tensor under the name the saved layers gave it): Transformer Engine's
    spec and the local one, grouped GEMM experts (TEGroupedMLP) or SequentialMLP, either way. Every parameter of one is
    a parameter of the other, the same tensor under another name (param_names.param_key: TE's fused norm weights are
    the norms' weights, grouped expert j's `weight{j}` is SequentialMLP's expert j), and so is its optimizer state;
    LoRA adapters have the same names under both. Module extra state does not map (TE's FP8 scaling state has no
    counterpart in the local layers, which keep None): this trainer's own is kept.
    Refused: a checkpoint of the older layout (no "format": a full replica per rank, read by name with no map)
    written by other layers. A checkpoint from before the record (no `layers`) is not checked."""
    saved = meta.get("layers")
    if saved is None or meta.get("format") is not None or (
            bool(saved.get("te")), bool(saved.get("grouped_gemm"))) == (bool(layers.get("te")),
                                                                       bool(layers.get("grouped_gemm"))):
        return
    raise ValueError(f"checkpoint {where} has the older layout and was written by {describe_layers(saved)}; this "
                     f"trainer builds {describe_layers(layers)} (trainer.use_te): it resumes only under the same "
                     "layers; a new run can start from its HF export (model.path)")


def legacy_problem(meta: dict, tp: int, ep: int, world_size: int, distributed: bool, saved_distributed: bool,
                   where: str) -> str | None:
    """None when a checkpoint of the older layout (no "format" in meta.json: a full model and optimizer replica per
    rank) can be loaded into this trainer; else one line naming the checkpoint and what differs. `distributed`:
    this trainer loads distributed-optimizer state; `saved_distributed`: the checkpoint holds such state."""
    if meta.get("format") is not None:
        return None
    old = f"checkpoint {where} has the older layout (a full replica per rank)"
    for key, have in (("tp", tp), ("ep", ep)):
        if meta[key] != have:
            return (f"{old}, written with {key}={meta[key]}; this trainer has {key}={have}: it loads only at the "
                    f"same {key}")
    if distributed != saved_distributed:
        kinds = {True: "distributed", False: "plain"}
        return (f"{old} with {kinds[saved_distributed]}-optimizer state; this trainer uses the "
                f"{kinds[distributed]} optimizer: set trainer.use_distributed_optimizer="
                f"{str(saved_distributed).lower()} to resume it (the next save is in the new layout)")
    if distributed and meta["world_size"] != world_size:
        return (f"{old} with distributed-optimizer state of world size {meta['world_size']}; this trainer has "
                f"{world_size} ranks: resume at the saved size (the next save is in the new layout)")
    return None
