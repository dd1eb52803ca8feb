"""MXFP4 expert weights (gpt-oss's released checkpoints) dequantised, once, into a full-precision HF directory.

    gspo-ray models dequantize-mxfp4 --src DIR --out DIR [--dtype bfloat16]
    w = dequantize_mxfp4(blocks, scales)        # [E, R, C/32, 16] uint8 x [E, R, C/32] uint8 -> [E, C, R]

The format (transformers 5.19's integrations/mxfp4.py, `convert_moe_packed_tensors`, the same pure-torch unpacking):
`<name>_blocks` holds two FP4 (e2m1) codes a byte, low nibble first, 32 values a block; `<name>_scales` one
E8M0 exponent a block (biased by 127). Value = FP4_VALUES[code] * 2^(scale - 127). The rows come out [E, R, C] and
are transposed to transformers' in-memory layout [E, C, R] (gate_up_proj [E, H, 2F], down_proj [E, F, H]), what a
gpt-oss checkpoint without quantization holds.

What serves and what trains: the dequantised directory has no `quantization_config`, so the engine serves the
experts in the run's dtype (vLLM's unquantized MoE) and the trainer trains the same full-precision tensors; pushes
send them as they are. Nothing is re-quantised (an export is full precision too). The trainer refuses an MXFP4
directory by name (families/gpt_oss.py): dequantise it first with this command.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [E, R, G, B] uint8 (2 codes a byte), scales [E, R, G] uint8 -> [E, G * B * 2, R] in `dtype`."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    *prefix, groups, width = blocks.shape
    codes = blocks.to(torch.uint8).reshape(-1, width)
    out = torch.empty(codes.shape[0], width * 2, dtype=dtype)
    out[:, 0::2] = lut[(codes & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(codes >> 4).to(torch.int)]
    out = torch.ldexp(out, scales.to(torch.int32).reshape(-1, 1) - 127)
    return out.reshape(*prefix, groups * width * 2).transpose(1, 2).contiguous()


def dequantize_checkpoint(src: str | Path, out: str | Path, dtype: str = "bfloat16") -> Path:
    """A gpt-oss HF directory with MXFP4 experts -> `out` with every `<name>_blocks` / `<name>_scales` pair as
    `<name>` in `dtype` (other tensors copied as they are), config.json without its quantization_config, the
    side files (tokenizer, chat template, generation config) copied. Whole files at a time."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    cfg = json.loads((src / "config.json").read_text())
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant != "mxfp4":
        raise ValueError(f"{src}/config.json: quantization_config.quant_method {quant!r} is not mxfp4")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")) and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    weight_map = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as h:
            names = set(h.keys())
            tensors = {}
            for name in sorted(names):
                if name.endswith("_scales"):
                    continue
                if name.endswith("_blocks"):
                    base = name[: -len("_blocks")]
                    tensors[base] = dequantize_mxfp4(h.get_tensor(name), h.get_tensor(base + "_scales"),
                                                     DTYPES[dtype])
                else:
                    tensors[name] = h.get_tensor(name)
        save_file(tensors, str(out / path.name), metadata={"format": "pt"})
        weight_map |= {n: path.name for n in tensors}
    if (src / "model.safetensors.index.json").exists():
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                     indent=2))
    cfg.pop("quantization_config")
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
