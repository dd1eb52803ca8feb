"""Qwen3-Next's layers inside Megatron, one spawned process. Gated DeltaNet (trainer/gated_delta/megatron_layer.py): a
TransformerLayer of the local spec with GatedDeltaAttention as its self_attention, HF weights loaded by name, equals
transformers' Qwen3NextDecoderLayer (a linear_attention layer with a dense MLP) per sequence, fp32, 1e-5: padded
rows, and a group row [prefix | c_1 | c_2] beside a sequence packed into one row (the Segments record travels as
Megatron's attention_mask). Qwen3-Next's norms are zero-centred (output x (1 + weight)): Megatron's RMSNorm gets 1 +
weight. trainer.tp 2 / trainer.cp 2 refused at construction, naming the field. And the gated softmax attention
(trainer/attention/gated_attention.py): Megatron's SelfAttention with attention_output_gate, SegmentAttention, zero-
centred QK-norm and RoPE over a quarter of each head, q_proj merged into linear_qkv by merge_gated_qkv, equals
transformers' Qwen3NextAttention (eager, causal) per padded row, relative 1e-5. (Megatron stays out of the pytest
process.)"""
from __future__ import annotations

import pytest
import torch

from _spawn import run_ranks

HIDDEN, FFN = 32, 48
P, C1, C2, N = 70, 5, 3, 9  # a prefix across a chunk boundary; short completions; a sequence


def hf_decoder_layer():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

    cfg = Qwen3NextConfig(hidden_size=HIDDEN, intermediate_size=FFN, linear_num_key_heads=2, linear_key_head_dim=8,
                          linear_num_value_heads=4, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                          num_hidden_layers=1, layer_types=["linear_attention"], mlp_only_layers=[0],
                          num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    layer = Qwen3NextDecoderLayer(cfg, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return cfg, layer


HEADS, GROUPS, HEAD_DIM, ROTARY = 4, 2, 16, 0.25


def hf_attention():
    """transformers' Qwen3NextAttention (std-0.3 weights, norms included) and its rotary embedding."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRotaryEmbedding

    cfg, _ = hf_decoder_layer()
    cfg.head_dim, cfg._attn_implementation = HEAD_DIM, "eager"
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": ROTARY}
    torch.manual_seed(2)
    attn = Qwen3NextAttention(cfg, 0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
    return attn, Qwen3NextRotaryEmbedding(cfg)


def _build_attention(hf_state: dict):
    """Megatron's SelfAttention with the output gate, SegmentAttention and zero-centred QK-norm, HF weights."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from gspo_ray.trainer.attention.gated_attention import ZeroCenteredRMSNorm, merge_gated_qkv
    from gspo_ray.trainer.model import SegmentAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS, kv_channels=HEAD_DIM,
        ffn_hidden_size=FFN, normalization="RMSNorm", layernorm_epsilon=1e-6, add_bias_linear=False,
        attention_output_gate=True, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
        apply_rope_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, use_cpu_initialization=True,
        params_dtype=torch.float32)
    spec = specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm").submodules.self_attention
    spec.submodules.core_attention = ModuleSpec(module=SegmentAttention, params={"kernel": "sdpa"})
    spec.submodules.q_layernorm = spec.submodules.k_layernorm = ModuleSpec(module=ZeroCenteredRMSNorm)
    module = build_module(spec, config=config, layer_number=1)
    with torch.no_grad():
        module.linear_qkv.weight.copy_(merge_gated_qkv(hf_state["q_proj.weight"], hf_state["k_proj.weight"],
                                                       hf_state["v_proj.weight"], HEADS, GROUPS, HEAD_DIM))
        module.linear_proj.weight.copy_(hf_state["o_proj.weight"])
        module.q_layernorm.weight.copy_(hf_state["q_norm.weight"])
        module.k_layernorm.weight.copy_(hf_state["k_norm.weight"])
    return module


def _attention_outputs(hf_attn_state: dict, attn_rows: list):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from gspo_ray.trainer.attention.segment_attention import Segments

    module = _build_attention(hf_attn_state)
    width = max(r.shape[0] for r in attn_rows)
    x = torch.zeros(width, len(attn_rows), HIDDEN)
    for b, r in enumerate(attn_rows):
        x[:r.shape[0], b] = r
    rope = RotaryEmbedding(kv_channels=HEAD_DIM, rotary_percent=ROTARY, rotary_base=10000.0)(width)
    with torch.no_grad():
        out, _ = module(x, Segments.plain([r.shape[0] for r in attn_rows]), rotary_pos_emb=rope)
    return out


def _build(hf_state: dict, tp: int = 1, cp: int = 1):
    """The Megatron layer, HF weights loaded (norms: 1 + weight; fc1 = [gate; up])."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from gspo_ray.compat import megatron_cpu
    from gspo_ray.trainer.gated_delta.by_segment import DeltaHeads
    from gspo_ray.trainer.gated_delta.megatron_layer import GatedDeltaAttention

    megatron_cpu.apply()
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN, normalization="RMSNorm",
        layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=tp, context_parallel_size=cp, use_cpu_initialization=True,
        params_dtype=torch.float32)
    spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention = ModuleSpec(module=GatedDeltaAttention,
                                                params={"heads": DeltaHeads(2, 8, 4, 8), "conv_kernel": 4})
    layer = build_module(spec, config=config, layer_number=1)
    names = {"input_layernorm.weight": "input_layernorm.weight",
             "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
             "mlp.linear_fc2.weight": "mlp.down_proj.weight"}
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.startswith("self_attention.layer."):
                param.copy_(hf_state["linear_attn." + name.removeprefix("self_attention.layer.")])
            elif name == "mlp.linear_fc1.weight":
                param.copy_(torch.cat([hf_state["mlp.gate_proj.weight"], hf_state["mlp.up_proj.weight"]]))
            else:
                param.copy_(hf_state[names[name]] + (1.0 if "layernorm" in name else 0.0))
    return layer


def _scenario(rank, world_size, ports, hf_state, x_rows, hf_attn_state, attn_rows, rdzv):
    from gspo_ray.trainer.attention.segment_attention import Segments
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed

    init_distributed(0, 1, "", 0, init_method=f"file://{rdzv}/single")
    layer = _build(hf_state)
    prefix, c1, c2, seq = x_rows
    out = {}
    with torch.no_grad():
        width = P + C1
        padded = torch.zeros(width, 4, HIDDEN)
        for b, r in enumerate([torch.cat([prefix, c1]), torch.cat([prefix, c2]), seq]):
            padded[:r.shape[0], b] = r
        out["padded"] = layer(padded, attention_mask=Segments.plain([P + C1, P + C2, N, 0]))[0]
        packed = torch.cat([prefix, c1, c2, seq, torch.zeros(2, HIDDEN)])[:, None]
        segs = Segments(prefix=(P, N), completions=((C1, C2), ()), packed=True)
        out["packed"] = layer(packed, attention_mask=segs)[0][:, 0]
    refusals = {}
    for tp, cp in ((2, 1), (1, 2)):  # the check runs before any parallel group is needed
        try:
            _build(hf_state, tp=tp, cp=cp)
        except NotImplementedError as e:
            refusals[(tp, cp)] = str(e)
    out["refusals"] = refusals
    out["attention"] = _attention_outputs(hf_attn_state, attn_rows)
    destroy_distributed()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    _, layer = hf_decoder_layer()
    torch.manual_seed(1)
    x_rows = [torch.randn(n, HIDDEN) for n in (P, C1, C2, N)]
    prefix, c1, c2, seq = x_rows
    hf = {}
    with torch.no_grad():
        for name, row in (("c1", torch.cat([prefix, c1])), ("c2", torch.cat([prefix, c2])), ("seq", seq)):
            hf[name] = layer(row[None], position_embeddings=None)[0]
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    attn, rope = hf_attention()
    attn_rows = [torch.randn(n, HIDDEN) for n in (9, 4)]
    with torch.no_grad():
        for i, row in enumerate(attn_rows):
            n = row.shape[0]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            hf[("attention", i)] = attn(row[None], rope(row[None], torch.arange(n)[None]), mask)[0][0]
    attn_state = {k: v.clone() for k, v in attn.state_dict().items()}
    got = run_ranks(_scenario, world_size=1, args=(state, x_rows, attn_state, attn_rows,
                                                    str(tmp_path_factory.mktemp("gdn_rdzv"))))[0]
    return got, hf


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the larger of 1 and the reference's largest magnitude (outputs reach ~10
    here: fp32 rounding is relative)."""
    return float((got - want).abs().max() / max(1.0, float(want.abs().max())))


def test_megatron_layer_equals_transformers_decoder_layer(results):
    got, hf = results
    padded, packed = got["padded"], got["packed"]
    pairs = [(padded[:P + C1, 0], hf["c1"]), (padded[:P + C2, 1], hf["c2"]), (padded[:N, 2], hf["seq"]),
             # the group row: its prefix once, each completion from the prefix's states; then the packed sequence
             (packed[:P + C1], hf["c1"]), (packed[P + C1:P + C1 + C2], hf["c2"][P:]),
             (packed[P + C1 + C2:P + C1 + C2 + N], hf["seq"])]
    diffs = [rel_diff(g, w) for g, w in pairs]
    print("relative differences", diffs)
    assert max(diffs) < 1e-5, diffs
    assert torch.count_nonzero(packed[P + C1 + C2 + N:]) == 0  # the tail padding


def test_tp_and_cp_refused_by_name(results):
    refusals = results[0]["refusals"]
    assert "trainer.tp 2" in refusals[(2, 1)] and "trainer.cp 2" in refusals[(1, 2)]


def test_gated_attention_equals_transformers(results):
    got, hf = results
    out = got["attention"]
    diffs = [rel_diff(out[:n, i], hf[("attention", i)]) for i, n in enumerate((9, 4))]
    print("gated attention relative differences", diffs)
    assert max(diffs) < 1e-5, diffs


def test_gated_qkv_layout_round_trips():
    from gspo_ray.trainer.attention.gated_attention import merge_gated_qkv, split_gated_qkv

    q, k, v = torch.randn(HEADS * 2 * HEAD_DIM, 8), torch.randn(GROUPS * HEAD_DIM, 8), torch.randn(GROUPS * HEAD_DIM, 8)
    fused = merge_gated_qkv(q, k, v, HEADS, GROUPS, HEAD_DIM)
    assert all(torch.equal(a, b) for a, b in zip(split_gated_qkv(fused, HEADS, GROUPS, HEAD_DIM), (q, k, v)))
    # group 0's rows: its 2 query heads' q (HF rows 0..15, 32..47), then their gates (16..31, 48..63), then k_0, v_0
    assert torch.equal(fused[:HEAD_DIM], q[:HEAD_DIM]) and torch.equal(fused[2 * HEAD_DIM:3 * HEAD_DIM],
                                                                      q[HEAD_DIM:2 * HEAD_DIM])
