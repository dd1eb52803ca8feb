"""models/mxfp4.py: MXFP4 unpacking against hand-packed values and transformers' own convert_moe_packed_tensors,
and a synthetic packed checkpoint dequantised into a directory without quantization_config."""
from __future__ import annotations

import json

import pytest
import torch

from gspo_ray.models.mxfp4 import FP4_VALUES, dequantize_checkpoint, dequantize_mxfp4


def test_hand_packed_values_and_transformers_agree():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    # one expert, one row, one block of 32: codes 0..15 twice (low nibble first), exponent 2^1
    codes = torch.arange(32) % 16
    blocks = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).view(1, 1, 1, 16)
    scales = torch.full((1, 1, 1), 128, dtype=torch.uint8)
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == (1, 32, 1)
    assert got[0, :, 0].tolist() == [2 * FP4_VALUES[int(c)] for c in codes]
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 10, 4), generator=g, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype),
                           convert_moe_packed_tensors(blocks, scales, dtype=dtype))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[:, :, :2])


def test_a_packed_checkpoint_is_dequantised_into_a_plain_directory(tmp_path):
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (2, 8, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(124, 130, (2, 8, 2), generator=g, dtype=torch.uint8)
    bias = torch.randn(2, 8, generator=g)
    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.layers.0.mlp.experts.gate_up_proj_blocks": blocks,
               "model.layers.0.mlp.experts.gate_up_proj_scales": scales,
               "model.layers.0.mlp.experts.gate_up_proj_bias": bias}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "gpt_oss",
                                                 "quantization_config": {"quant_method": "mxfp4"}}))
    (src / "tokenizer.json").write_text("{}")
    out = dequantize_checkpoint(src, tmp_path / "out", "float32")
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.gate_up_proj_bias"}
    assert torch.equal(tensors["model.layers.0.mlp.experts.gate_up_proj"], dequantize_mxfp4(blocks, scales))
    assert torch.equal(tensors["model.layers.0.mlp.experts.gate_up_proj_bias"], bias)
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32" and (out / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="is not mxfp4"):
        dequantize_checkpoint(out, tmp_path / "again")
