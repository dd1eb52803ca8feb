"""The installed vLLM's (major, minor), which every version guard of gspo_ray/compat/ (and the in-memory adapter
swap) compares with the versions its workaround was checked on.

    from gspo_ray.compat.vllm_version import vllm_minor
    if vllm_minor() in ((0, 32),): ...
"""
from __future__ import annotations


def parse_minor(version: str) -> tuple[int, int]:
    """'0.32.0+cpu' -> (0, 32)."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def vllm_minor() -> tuple[int, int]:
    import vllm

    return parse_minor(vllm.__version__)
