"""HF <-> Megatron converter: layout maths, and exact export round trips from every layout.

Unit tests pin the fused layouts (qkv per query group, [gate; up] split per TP rank, padded vocabulary); spawned
scenarios load the tiny HF checkpoints into TP1, TP2+SP, EP2 and TP2+SP x EP2, export them back and compare with the
original safetensors bit for bit, then save HF directories that transformers must load to the same logits.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _spawn import run_ranks
from gspo_ray.trainer.weights.bridge import (HFCheckpoint, ParamMap, merge_hf, param_map, shard_tp,
                                             split_to_hf, unshard_tp)
from gspo_ray.trainer.model_spec import ModelSpec, spec_from_hf_config


def _spec(heads=4, kv_heads=2, head_dim=3, vocab=7, tp=1) -> ModelSpec:
    return ModelSpec(arch="qwen2", hf_config={}, hf_dir="", vocab_size=vocab, padded_vocab_size=-(-vocab // tp) * tp,
                     num_layers=1, hidden_size=5, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                     ffn_hidden_size=8, tp=tp)


# ---- pure layout maths -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,hf,merge,shard,expert", [
    ("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "copy", "vocab", None),
    ("output_layer.weight", ("lm_head.weight",), "copy", "vocab", None),
    ("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", "none", None),
    ("decoder.layers.3.self_attention.linear_qkv.weight",
     tuple(f"model.layers.3.self_attn.{p}_proj.weight" for p in "qkv"), "qkv", "col", None),
    ("decoder.layers.0.self_attention.linear_qkv.bias",
     tuple(f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"), "qkv", "col", None),
    ("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",  # Transformer Engine spec name
     ("model.layers.1.input_layernorm.weight",), "copy", "none", None),
    ("decoder.layers.1.self_attention.q_layernorm.weight", ("model.layers.1.self_attn.q_norm.weight",), "copy",
     "none", None),
    ("decoder.layers.1.self_attention.linear_proj.weight", ("model.layers.1.self_attn.o_proj.weight",), "copy",
     "row", None),
    ("decoder.layers.1.pre_mlp_layernorm.weight", ("model.layers.1.post_attention_layernorm.weight",), "copy",
     "none", None),
    ("decoder.layers.1.mlp.linear_fc1.weight",
     ("model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"), "gated", "col", None),
    ("decoder.layers.1.mlp.linear_fc2.weight", ("model.layers.1.mlp.down_proj.weight",), "copy", "row", None),
    ("decoder.layers.2.mlp.router.weight", ("model.layers.2.mlp.gate.weight",), "copy", "none", None),
    ("decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight",
     ("model.layers.2.mlp.experts.{e}.gate_proj.weight", "model.layers.2.mlp.experts.{e}.up_proj.weight"),
     "gated", "none", 1),
    ("decoder.layers.2.mlp.experts.local_experts.0.linear_fc2.weight",
     ("model.layers.2.mlp.experts.{e}.down_proj.weight",), "copy", "none", 0),
])
def test_param_map(name, hf, merge, shard, expert):
    assert param_map(name) == ParamMap(hf, merge, shard, expert)


def test_param_map_rejects_unknown_names():
    with pytest.raises(KeyError, match="decoder.layers.0.mlp.shared_experts"):
        param_map("decoder.layers.0.mlp.shared_experts.linear_fc1.weight")


def test_qkv_fused_per_query_group():
    spec = _spec(heads=4, kv_heads=2, head_dim=1)
    # one row per head, valued by its role: q heads 0..3, k groups 10/11, v groups 20/21
    q, k, v = torch.tensor([[0.], [1.], [2.], [3.]]), torch.tensor([[10.], [11.]]), torch.tensor([[20.], [21.]])
    fused = merge_hf([q, k, v], "qkv", spec)
    # [group 0: q0 q1 k0 v0 | group 1: q2 q3 k1 v1]
    assert fused[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert all(torch.equal(a, b) for a, b in zip(split_to_hf(fused, "qkv", spec), (q, k, v)))
    # TP=2 gives each rank whole groups
    assert shard_tp(fused, ParamMap((), "qkv", "col"), spec, 2, 1)[:, 0].tolist() == [2, 3, 11, 21]
    bias = merge_hf([q[:, 0], k[:, 0], v[:, 0]], "qkv", spec)
    assert bias.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


def test_uneven_split_is_refused():
    with pytest.raises(ValueError, match="evenly over tp=4"):
        shard_tp(torch.zeros(4, 6), ParamMap((), "copy", "row"), _spec(), 4, 0)


def test_gated_fc1_splits_gate_and_up_per_rank():
    gate, up = torch.arange(4.)[:, None], 10 + torch.arange(4.)[:, None]
    full = merge_hf([gate, up], "gated", _spec())
    pm = ParamMap((), "gated", "col")
    shards = [shard_tp(full, pm, _spec(), 2, r) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0, 1, 10, 11] and shards[1][:, 0].tolist() == [2, 3, 12, 13]
    assert torch.equal(unshard_tp(shards, pm, _spec()), full)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("merge,shard", [("copy", "none"), ("copy", "row"), ("copy", "col"), ("copy", "vocab"),
                                         ("gated", "col"), ("qkv", "col")])
def test_shard_unshard_round_trip(tp, merge, shard):
    spec = _spec(heads=4, kv_heads=4, head_dim=2, vocab=7, tp=tp)
    rows = {"vocab": 7, "qkv": 3 * 4 * 2}.get(shard if shard == "vocab" else merge, 8)
    full = torch.randn(rows, 8)
    pm = ParamMap((), merge, shard)
    shards = [shard_tp(full, pm, spec, tp, r) for r in range(tp)]
    assert torch.equal(unshard_tp(shards, pm, spec), full)
    if shard == "vocab":  # rows padded with zeros up to a multiple of tp
        assert sum(s.shape[0] for s in shards) == spec.padded_vocab_size
        assert torch.all(torch.cat(shards)[7:] == 0)


def test_reader_serves_fused_experts_under_per_expert_names(tiny_moe_dir, tmp_path):
    """transformers 5 holds experts fused in memory ([E, 2F, H] gate_up_proj); such files read like saved ones."""
    from transformers import AutoModelForCausalLM

    fused = AutoModelForCausalLM.from_pretrained(str(tiny_moe_dir), dtype=torch.float32).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    save_file({k: v.contiguous() for k, v in fused.items()}, str(tmp_path / "model.safetensors"))
    saved = load_file(str(Path(tiny_moe_dir) / "model.safetensors"))
    reader = HFCheckpoint(tmp_path)
    for name, tensor in saved.items():
        assert torch.equal(reader.get(name), tensor), name
    with pytest.raises(KeyError, match="model.layers.9.mlp.gate.weight"):
        reader.get("model.layers.9.mlp.gate.weight")


# ---- HF config -> ModelSpec --------------------------------------------------------------------------------------
def _hf_cfg(**kw) -> dict:
    base = dict(model_type="qwen3_moe", vocab_size=22, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    return base | kw


def test_spec_from_hf_config_reads_qwen3_moe():
    spec = spec_from_hf_config(_hf_cfg(mlp_only_layers=[1], decoder_sparse_step=1), "m", tp=2, ep=2)
    assert (spec.num_experts, spec.top_k, spec.moe_ffn_hidden_size, spec.num_local_experts) == (4, 2, 64, 2)
    assert spec.moe_layers == (0, 2, 3) and spec.qk_norm and not spec.qkv_bias
    assert spec.sequence_parallel and spec.padded_vocab_size == 22 and spec.extra["rope_theta"] == 5e5
    # transformers 5 writes num_local_experts; 4.x rope_theta sits at the top level
    legacy = _hf_cfg(num_local_experts=4, num_experts=None, rope_parameters=None, rope_theta=1e6)
    assert spec_from_hf_config(legacy, "m").num_experts == 4
    assert spec_from_hf_config(legacy, "m").extra["rope_theta"] == 1e6


def test_spec_for_dense_model_ignores_ep_and_pads_vocab():
    spec = spec_from_hf_config(_hf_cfg(model_type="qwen2", num_experts=None, vocab_size=23), "m", tp=2, ep=2)
    assert spec.ep == 1 and not spec.is_moe and spec.qkv_bias and spec.padded_vocab_size == 24


@pytest.mark.parametrize("change,match", [
    (dict(model_type="gpt2"), "model_type 'gpt2' not supported"),
    (dict(num_key_value_heads=1), "tp=2 must divide"),
    (dict(num_experts=3), "ep=2 must divide num_experts=3"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}), "rope type 'llama3'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(use_sliding_window=True), "sliding-window"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),  # attention by segment covers
    (dict(kv_lora_rank=512), "kv_lora_rank .multi-latent"),                       # full causal softmax only
    (dict(attention_sink_size=4), "attention_sink_size .attention sinks"),
])
def test_spec_refuses_what_it_cannot_express(change, match):
    with pytest.raises(ValueError, match=match):
        spec_from_hf_config(_hf_cfg(**change), "m", tp=2, ep=2)


# ---- export round trips in real layouts -------------------------------------------------------------------------
def _compare_with_safetensors(model, spec, hf_dir) -> dict:
    """Export in small buckets and compare with the original safetensors, name by name, bit for bit."""
    from gspo_ray.trainer.weights.bridge import export_hf_weights

    original = load_file(str(Path(hf_dir) / "model.safetensors"))
    limit = 0.01 * 2**20  # 10 KiB buckets: many buckets, some single tensors larger than the limit
    exported, oversize = {}, 0
    for bucket in export_hf_weights(model, spec, bucket_mb=0.01):
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        oversize += size > limit and len(bucket) > 1
        exported.update(bucket)
    return {"missing": sorted(set(original) - set(exported)), "extra": sorted(set(exported) - set(original)),
            "different": sorted(n for n in original if n in exported and not torch.equal(original[n], exported[n])),
            "n": len(exported), "oversize_buckets": oversize}


def _export_layouts(rank, world_size, init_method, models, layouts, out_dir, unknown_dir=None) -> dict:
    from megatron.core import parallel_state

    from gspo_ray.trainer.weights.bridge import save_hf_checkpoint
    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed

    out = {}
    for layout, tp, ep, archs in layouts:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()  # keep the process group, rebuild TP/EP groups
        init_distributed(rank, world_size, "", 0, tp=tp, ep=ep, init_method=init_method)
        for arch in archs:
            model, spec = build_model(models[arch])
            out[(layout, arch)] = _compare_with_safetensors(model, spec, models[arch])
            save_hf_checkpoint(model, spec, Path(out_dir) / f"{layout}_{arch}")
    if unknown_dir is not None:
        try:
            build_model(unknown_dir)
            out["unknown_tensor"] = None
        except ValueError as e:
            out["unknown_tensor"] = str(e)
    destroy_distributed()
    return out


def _scenario(rank, world_size, ports, models, out_dir, unknown_dir):
    """Rank 0 first exports from a world of its own (TP1), then both ranks go through the 2-rank layouts.
    Rendezvous through files in out_dir (no TCP port to race for while other jobs share the machine)."""
    single = {}
    if rank == 0:
        single = _export_layouts(0, 1, f"file://{out_dir}/rdzv_single", models, SINGLE, out_dir, unknown_dir)
    return single | _export_layouts(rank, world_size, f"file://{out_dir}/rdzv_pair", models, PAIRS, out_dir)


SINGLE = [("tp1", 1, 1, ("qwen2", "qwen3_moe", "llama"))]
PAIRS = [("tp2_sp", 2, 1, ("qwen2", "qwen3_moe", "llama")), ("ep2", 1, 2, ("qwen3_moe",)),
         ("tp2_sp_ep2", 2, 2, ("qwen3_moe",))]
CASES = [(layout, arch) for layout, _, _, archs in SINGLE + PAIRS for arch in archs]


@pytest.fixture(scope="module")
def exports(tiny_models, tmp_path_factory):
    models = {arch: v[0] for arch, v in tiny_models.items()}
    out_dir = tmp_path_factory.mktemp("hf_out")
    # the qwen2 checkpoint plus an o_proj bias, which the Megatron config has no place for
    unknown = tmp_path_factory.mktemp("unknown")
    shutil.copytree(models["qwen2"], unknown, dirs_exist_ok=True)
    tensors = load_file(str(unknown / "model.safetensors"))
    tensors["model.layers.1.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(unknown / "model.safetensors"))
    args = (models, str(out_dir), str(unknown))
    return {"ranks": run_ranks(_scenario, 2, args, n_ports=0), "out_dir": out_dir}


def test_unknown_checkpoint_tensor_is_refused(exports):
    assert "model.layers.1.self_attn.o_proj.bias" in exports["ranks"][0]["unknown_tensor"]


@pytest.mark.parametrize("layout,arch", CASES)
def test_export_equals_original_safetensors(exports, layout, arch):
    ranks = exports["ranks"][:1] if layout == "tp1" else exports["ranks"]
    for rank, res in enumerate(ranks):  # every rank yields the full tensors
        r = res[(layout, arch)]
        assert not r["missing"] and not r["extra"], f"rank {rank}: missing {r['missing']}, extra {r['extra']}"
        assert not r["different"], f"rank {rank}: tensors differ: {r['different']}"
        assert r["oversize_buckets"] == 0


def _logits(hf_dir, tokens):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)(tokens).logits


@pytest.mark.parametrize("layout,arch", CASES)
def test_saved_checkpoint_loads_in_transformers(exports, tiny_models, layout, arch):
    from transformers import AutoTokenizer

    hf_dir, tokens = tiny_models[arch][:2]
    saved = exports["out_dir"] / f"{layout}_{arch}"
    assert torch.equal(_logits(saved, tokens), _logits(hf_dir, tokens))
    src, dst = AutoTokenizer.from_pretrained(hf_dir), AutoTokenizer.from_pretrained(str(saved))
    assert src.get_vocab() == dst.get_vocab() and dst.eos_token_id == src.eos_token_id
