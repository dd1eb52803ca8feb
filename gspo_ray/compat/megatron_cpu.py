"""CPU workarounds for megatron-core 0.16.1 (no CUDA, no Transformer Engine, no apex).

    from gspo_ray.compat import megatron_cpu
    megatron_cpu.apply()                    # no-op when CUDA is available; idempotent
    with megatron_cpu.cpu_device_mode():    # around Megatron DDP/optimizer construction and every step
        optimizer = get_megatron_optimizer(...)
    with megatron_cpu.unapplied("rng_tracker"):   # tests: lift one patch to see the original failure
        ...

`apply()` installs the global patches listed in `WORKAROUNDS` (name -> installer; init_distributed and build_model
call it); `cpu_device_mode()` is workaround 7, a context manager because it must not leak into the rest of the
process:

1. `current_device`: `torch.cuda.current_device()` (rotary embedding, router, all-to-all buffers) returns the CPU
   device instead of raising "Torch not compiled with CUDA enabled".
2. `rng_tracker`: the model-parallel CUDA RNG tracker (`CudaRNGStatesTracker.add`, `_get/_set_cuda_rng_state`)
   keeps CPU generator states, so `model_parallel_cuda_manual_seed` and attention's `get_cuda_rng_tracker().fork()`
   work (both raise "Torch not compiled with CUDA enabled" otherwise; a failed seeding later shows up as
   "cuda rng state model-parallel-rng is not added").
3. `te_general_gemm`: without Transformer Engine, `moe_utils.te_general_gemm` is never defined (NameError in the
   router's gating GEMM) -> define it as None so the torch fallback runs.
4. `cuda_streams`: the alltoall token dispatcher creates `torch.cuda.Stream()` and records/waits events -> no-op
   stand-ins (classes, so annotations such as `torch.cuda.Stream | None` elsewhere stay valid).
5. `alltoall_split_sizes`: with EP > 1 the dispatcher passes split sizes as tensors (they are only converted when
   they live on a GPU) and gloo's `all_to_all_single` rejects them -> convert to lists of ints.
6. `torch_norm_sequence_parallel`: the torch LayerNorm/RMSNorm wrapper asserts `not sequence_parallel`; the norm
   maths does not care, so allow it and mark the weights `sequence_parallel` so their gradients get all-reduced
   across TP by `finalize_model_grads`.
8. `cuda_synchronize`: the pipeline schedules' point-to-point exchange (`p2p_communication`: the tensor shapes of
   `variable_seq_lengths`, and `batch_p2p_sync`) calls `torch.cuda.synchronize()` unconditionally -> a no-op (CPU
   work and gloo's waited requests are already synchronous).
7. `cpu_device_mode()`: Megatron's DDP buffers and optimizers hard-code `device='cuda'`, `.cuda()` and
   `param.type() == 'torch.cuda.FloatTensor'` checks -> a `TorchFunctionMode` rewrites cuda devices to CPU, makes
   `.cuda()` a no-op and reports CPU tensor types under their CUDA names.

Each one is proven still needed and still correct by tests/compat/test_megatron_cpu.py.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

# Versions these patches were verified against (tests/compat/test_megatron_cpu.py); others get a warning.
TESTED_MCORE_VERSIONS = ("0.16.1",)
_applied: set[str] = set()
_MISSING = object()
# name -> [(object, attribute, original value, patched value)], so a patch can be lifted again (tests do)
_patches: dict[str, list[tuple[object, str, object, object]]] = {}
_installing: str | None = None


def _set(obj, attr: str, value) -> None:
    """setattr that remembers the original for `unapplied()`."""
    _patches.setdefault(_installing, []).append((obj, attr, obj.__dict__.get(attr, _MISSING), value))
    setattr(obj, attr, value)


def needed() -> bool:
    """The patches are for machines without CUDA only."""
    return not torch.cuda.is_available()


def mcore_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


# ---- 1. torch.cuda.current_device -------------------------------------------------------------------------------
def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _patch_current_device() -> None:
    _set(torch.cuda, "current_device", _cpu_current_device)


# ---- 2. CUDA RNG tracker on the CPU generator --------------------------------------------------------------------
def _get_rng_state_cpu(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state_cpu(new_state: torch.Tensor, device=-1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _tracker_add_cpu(self, name: str, seed: int) -> None:
    """CudaRNGStatesTracker.add, with the state drawn from a private CPU generator (the global one is untouched)."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    self.states_[name] = gen.get_state()


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    _set(mrandom, "_get_cuda_rng_state", _get_rng_state_cpu)
    _set(mrandom, "_set_cuda_rng_state", _set_rng_state_cpu)
    _set(mrandom.CudaRNGStatesTracker, "add", _tracker_add_cpu)


# ---- 3. te_general_gemm NameError --------------------------------------------------------------------------------
def _patch_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        _set(moe_utils, "te_general_gemm", None)


# ---- 4. torch.cuda.Stream / Event stand-ins ----------------------------------------------------------------------
class NullEvent:
    """Stands in for torch.cuda.Event: CPU work is synchronous, so there is nothing to wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self) -> bool:
        return True


class NullStream:
    """Stands in for torch.cuda.Stream (one shared 'stream': every comparison with the current one is equal)."""

    def __init__(self, *args, **kwargs):
        pass

    def __eq__(self, other):
        return isinstance(other, NullStream)

    def __hash__(self):
        return 0

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else NullEvent()

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True


_NULL_STREAM = NullStream()


def _patch_cuda_streams() -> None:
    _set(torch.cuda, "Stream", NullStream)
    _set(torch.cuda, "Event", NullEvent)
    _set(torch.cuda, "current_stream", lambda device=None: _NULL_STREAM)
    _set(torch.cuda, "default_stream", lambda device=None: _NULL_STREAM)
    _set(torch.cuda, "stream", lambda stream=None: contextlib.nullcontext())


# ---- 5. gloo all_to_all_single split sizes -----------------------------------------------------------------------
def _as_int_list(sizes):
    if sizes is None or isinstance(sizes, list):
        return sizes
    if torch.is_tensor(sizes):
        return [int(s) for s in sizes.tolist()]
    return [int(s) for s in sizes]  # numpy arrays, tuples


def _patch_alltoall_split_sizes() -> None:
    from megatron.core.tensor_parallel import mappings

    forward = mappings._AllToAll.forward

    def forward_with_lists(ctx, group, input, output_split_sizes, input_split_sizes):
        return forward(ctx, group, input, _as_int_list(output_split_sizes), _as_int_list(input_split_sizes))

    _set(mappings._AllToAll, "forward", staticmethod(forward_with_lists))


# ---- 6. torch norm wrapper under sequence parallelism -------------------------------------------------------------
def _patch_torch_norm_sequence_parallel() -> None:
    from megatron.core.transformer import torch_norm

    new = torch_norm.WrappedTorchNorm.__new__

    def new_allowing_sp(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return new(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)  # a shallow copy only to get past the assertion; the norm keeps no config
        plain.sequence_parallel = False
        norm = new(cls, plain, hidden_size, *args, **kwargs)
        # Under SP each TP rank normalises a different slice of tokens: finalize_model_grads sums these grads
        # over TP for params marked like this (q/k layernorms are summed by name anyway, so marking them is moot).
        for p in norm.parameters():
            setattr(p, "sequence_parallel", True)
        return norm

    _set(torch_norm.WrappedTorchNorm, "__new__", staticmethod(new_allowing_sp))


# ---- 8. torch.cuda.synchronize in the pipeline's point-to-point exchange ------------------------------------------
def _patch_cuda_synchronize() -> None:
    _set(torch.cuda, "synchronize", lambda device=None: None)


WORKAROUNDS: dict[str, Callable[[], None]] = {
    "current_device": _patch_current_device,
    "rng_tracker": _patch_rng_tracker,
    "te_general_gemm": _patch_te_general_gemm,
    "cuda_streams": _patch_cuda_streams,
    "alltoall_split_sizes": _patch_alltoall_split_sizes,
    "torch_norm_sequence_parallel": _patch_torch_norm_sequence_parallel,
    "cuda_synchronize": _patch_cuda_synchronize,
}


def apply() -> list[str]:
    """Install the CPU patches, once per process and only without CUDA. Returns the names installed by this call."""
    global _installing
    if not needed():
        return []
    version = mcore_version()
    if version not in TESTED_MCORE_VERSIONS and not _applied:
        warnings.warn(f"megatron-core {version}: the CPU workarounds were verified for {TESTED_MCORE_VERSIONS}; "
                      "run tests/compat/test_megatron_cpu.py to see which are still needed", stacklevel=2)
    done = []
    for name, install in WORKAROUNDS.items():
        if name in _applied:
            continue
        _installing = name
        try:
            install()
        finally:
            _installing = None
        _applied.add(name)
        done.append(name)
    if done:
        log.debug("megatron CPU workarounds applied: %s", done)
    return done


def applied() -> frozenset[str]:
    return frozenset(_applied)


@contextlib.contextmanager
def unapplied(name: str):
    """Lift one installed patch for the duration of the block (tests show the original still fails)."""
    if name not in _applied:
        raise ValueError(f"workaround {name!r} is not applied; applied: {sorted(_applied)}; "
                         f"valid: {', '.join(WORKAROUNDS)}")
    patches = _patches[name]
    for obj, attr, original, _ in reversed(patches):
        if original is _MISSING:
            delattr(obj, attr)
        else:
            setattr(obj, attr, original)
    try:
        yield
    finally:
        for obj, attr, _, patched in patches:
            setattr(obj, attr, patched)


# ---- 7. device rewriting for DDP and optimizers ------------------------------------------------------------------
def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a bare index means a CUDA ordinal


class CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA placement to CPU for every torch call made inside it (see module docstring, item 7)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]  # already on the only device there is
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # 'torch.FloatTensor' -> 'torch.cuda.FloatTensor', the names Megatron's dtype checks expect
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if i and _is_cuda(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


def cpu_device_mode():
    """Context manager for Megatron DDP/optimizer construction and steps; a no-op context when CUDA is present."""
    return CpuDeviceMode() if needed() else contextlib.nullcontext()
