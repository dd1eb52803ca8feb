"""requirements/cuda.lock (the CUDA set: vLLM, megatron-core, Transformer Engine and the torch they share) holds
together: every requirement its packages declare on torch, and Transformer Engine's on its CUDA core, is met by the
locked versions, as recorded in the lock's metadata block (read from the index when the lock was made; no network
here), and pyproject.toml's `cuda` extra pins what the lock holds. The set cannot be installed on this CPU machine."""
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "cuda.lock"


def read_lock() -> tuple[dict[str, Version], dict[str, list[Requirement]]]:
    """({package: locked version}, {package: the requirements recorded for it in the metadata block})."""
    text = LOCK.read_text()
    pins = {canonicalize_name(m[1]): Version(m[2]) for m in re.finditer(r"^([A-Za-z0-9_.\-]+)==(\S+)$", text, re.M)}
    recorded: dict[str, list[Requirement]] = {}
    for m in re.finditer(r"^# ([A-Za-z0-9_.\-]+)==(\S+): (.+)$", text, re.M):
        name = canonicalize_name(m[1])
        assert pins.get(name) == Version(m[2]), f"metadata of {m[1]}=={m[2]}, but the lock holds {pins.get(name)}"
        recorded.setdefault(name, []).append(Requirement(m[3]))
    return pins, recorded


def test_the_lock_meets_what_its_packages_require():
    pins, recorded = read_lock()
    assert {"vllm", "megatron-core", "transformer-engine-torch"} <= recorded.keys()
    vllm_torch = [r for r in recorded["vllm"] if r.name == "torch"]
    # vLLM pins the torch it was built against: the lock's torch is exactly that one
    assert [str(r.specifier) for r in vllm_torch] == [f"=={pins['torch']}"]
    for package, reqs in recorded.items():
        for req in reqs:
            if req.marker is not None and not req.marker.evaluate({"extra": "pytorch"}):
                continue
            name = canonicalize_name(req.name)
            assert name in pins, f"{package} requires {req}, which the lock lacks"
            assert req.specifier.contains(pins[name], prereleases=True), \
                f"{package} requires {req}; the lock has {name}=={pins[name]}"


def test_transformer_engine_core_matches_torch_cuda():
    pins, _ = read_lock()
    # TE's PyTorch part builds against the installed torch and asks for the core of torch's CUDA major
    cores = [name for name in pins if re.fullmatch(r"transformer-engine-cu\d+", name)]
    cuda_major = pins["cuda-toolkit"].major  # torch's CUDA (torch requires cuda-toolkit on Linux)
    assert cores == [f"transformer-engine-cu{cuda_major}"]


def test_cuda_extra_pins_the_locked_versions():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cuda"]
    pins, _ = read_lock()
    for line in extra:
        req = Requirement(line)
        assert str(req.specifier).startswith("=="), f"the cuda extra pins exact versions: {line}"
        assert req.specifier.contains(pins[canonicalize_name(req.name)]), (line, pins[canonicalize_name(req.name)])
