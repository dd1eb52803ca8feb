"""The PEFT LoRA adapter format, which the trainer's exports and the engines' adapter pushes both write: the
tensor names, adapter_config.json and the directory (adapter_config.json + adapter_model.safetensors). No
Megatron and no vLLM here; trainer/lora/peft_io.py turns the trainer's shards into these tensors, and
rollout/lora_adapter.py hands them to vLLM.

    write_peft_dir(state, out_dir, rank=8, alpha=16, target_modules=["q_proj"])  # state: {PEFT name: tensor}
    cfg_json, tensors = read_peft_dir(adapter_dir)    # ValueError naming the path when it is not one

PEFT names (what `peft.PeftModel.from_pretrained` and vLLM's LoRA loader read):
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in], `...lora_B.weight` [out, r]; MoE
experts `base_model.model.model.layers.{i}.mlp.experts.{e}.gate_proj.lora_A.weight` (global expert index e).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def peft_names(hf_module: str) -> tuple[str, str]:
    return f"{PEFT_PREFIX}{hf_module}.lora_A.weight", f"{PEFT_PREFIX}{hf_module}.lora_B.weight"


def peft_config(state: dict[str, Tensor], rank: int, alpha: float, base_model: str = "") -> dict:
    """adapter_config.json of a plain LoRA adapter holding `state` (PEFT names): what peft and vLLM read. The
    trainer's exports and the engines' pushes (rollout/lora_adapter.py, scale folded in: alpha = rank) write it."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
            "target_modules": sorted({n.split(".")[-3] for n in state}), "bias": "none",
            "base_model_name_or_path": base_model, "fan_in_fan_out": False, "inference_mode": True,
            "use_rslora": False, "init_lora_weights": True, "modules_to_save": None}


def write_peft_dir(state: dict[str, Tensor], out_dir: str | Path, *, rank: int, alpha: float,
                   target_modules: list[str], base_model: str = "", dtype: torch.dtype = torch.float32) -> Path:
    """A PEFT LoRA adapter directory: adapter_config.json + adapter_model.safetensors (written to a temporary
    name, then renamed, so a reader never sees half a file)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = peft_config(state, rank, alpha, base_model)
    if set(config["target_modules"]) - set(target_modules):
        raise ValueError(f"adapter tensors target {config['target_modules']}, config says {target_modules}")
    tmp = out / (ADAPTER_WEIGHTS + ".tmp")
    save_file({k: v.detach().to(dtype).contiguous() for k, v in state.items()}, str(tmp))
    tmp.replace(out / ADAPTER_WEIGHTS)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_peft_dir(adapter_dir: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """(adapter_config.json, {name: tensor}) of a PEFT LoRA directory; ValueError naming the path otherwise."""
    from safetensors.torch import load_file

    d = Path(adapter_dir)
    cfg_path, weights = d / ADAPTER_CONFIG, d / ADAPTER_WEIGHTS
    if not d.is_dir():
        raise ValueError(f"{d}: not a directory (trainer.lora.init_from needs a PEFT adapter directory)")
    if not cfg_path.is_file() or not weights.is_file():
        raise ValueError(f"{d}: not a PEFT adapter directory (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    cfg = json.loads(cfg_path.read_text())
    if str(cfg.get("peft_type", "")).upper() != "LORA":
        raise ValueError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r}, only LORA adapters load")
    tensors = load_file(str(weights))
    # PEFT saves without the adapter name ('.lora_A.weight'); some tools keep '.lora_A.default.weight'
    return cfg, {k.replace(".default.weight", ".weight"): v for k, v in tensors.items()}


# adapter_config.json fields of LoRA variants the trainer cannot reproduce: (key, why)
UNSUPPORTED_PEFT = (
    ("use_rslora", "rsLoRA scales the update by alpha / sqrt(r), the trainer by alpha / r"),
    ("use_dora", "DoRA adds a magnitude vector the trainer does not have"),
    ("rank_pattern", "per-module ranks; the trainer uses one trainer.lora.rank"),
    ("alpha_pattern", "per-module alphas; the trainer uses one trainer.lora.alpha"),
)


def peft_kind_problem(cfg: dict) -> str | None:
    """Why an adapter_config.json describes a LoRA the trainer cannot load (None: plain LoRA), naming the field."""
    for key, why in UNSUPPORTED_PEFT:
        if cfg.get(key):
            return f"adapter_config.json sets {key}={json.dumps(cfg[key])}: {why} (plain LoRA only)"
    return None


def peft_rank_alpha(cfg: dict, where: str) -> tuple[int, float]:
    """(r, lora_alpha) of an adapter_config.json; the variants of UNSUPPORTED_PEFT are refused."""
    problem = peft_kind_problem(cfg)
    if problem:
        raise ValueError(f"{where}: {problem}")
    return int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
