"""Multi-latent attention by segment: Megatron's MLASelfAttention (local spec) with SegmentAttention as its core
attention, HF weights mapped by attention/mla.py's MLA_NAME_RULES, equals transformers' DeepseekV3Attention.

Two configs, weights drawn at std 0.3 (peaked attention: a near-uniform one agrees with a wrong convention to ~1e-3):
"lora_rope" (q_lora_rank 16, default RoPE) and "yarn_no_q_lora" (q_proj, YaRN with factor 4 over 16 original
positions, mscale 1.0 / mscale_all_dim 0.8: the concentration factor and the softmax mscale^2 both differ from 1).
Both have v_head_dim 24 against a q / k width of 32 (V padded for the fused kernel). Checked, fp32, tolerance 1e-5:
- padded rows (3 sequences, padding) equal transformers' attention output per sequence (eager, causal);
- group rows [prefix | c_1 | c_2] and packed rows [group unit | sequence | tail] equal the padded rows: outputs,
  the loss (completion and sequence tokens weighted, prefix tokens 0), every parameter's gradient and the
  input gradient (a prefix token's: the sum over the padded rows that repeat it);
- TP 2 with sequence parallelism (gloo, 2 processes): padded and packed rows equal the 1-process outputs and
  gradients (column shards, row shards, and the latent norms' partial gradients summed over TP).
"""
from __future__ import annotations

import pytest
import torch

from _spawn import run_ranks

TOL = 1e-5
P, C1, C2, N3 = 5, 4, 3, 6  # a prompt of 5 with completions of 4 and 3; a sequence of 6
CONFIGS = {
    "lora_rope": dict(q_lora_rank=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "yarn_no_q_lora": dict(q_lora_rank=None, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}),
}


def hf_config(name: str):
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(vocab_size=32, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                           v_head_dim=24, intermediate_size=64, max_position_embeddings=64, rms_norm_eps=1e-6,
                           **CONFIGS[name])
    cfg._attn_implementation = "eager"
    return cfg


def hf_attention(name: str):
    """transformers' DeepseekV3Attention with std-0.3 weights (norm weights near 1) and its rotary embedding."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    cfg = hf_config(name)
    g = torch.Generator().manual_seed(0)
    attn = DeepseekV3Attention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for pname, p in attn.named_parameters():
            base = 1.0 if "layernorm" in pname else 0.0
            p.copy_(base + torch.randn(p.shape, generator=g) * (0.1 if "layernorm" in pname else 0.3))
    return cfg, attn, DeepseekV3RotaryEmbedding(cfg)


def hf_outputs(attn, rope, x: torch.Tensor) -> torch.Tensor:
    """One sequence x [n, hidden] through transformers' attention at positions 0..n-1, causal."""
    n = x.shape[0]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        cos_sin = rope(x[None], torch.arange(n)[None])
        return attn(x[None], cos_sin, mask)[0][0]


def layouts():
    """The three layouts of the same tokens: (Segments, position ids [B, S], token index [B, S] into the logical
    tokens: group prefix 0..P-1, completion 1 P.., completion 2, then the sequence; -1 = padding)."""
    from gspo_ray.trainer.attention.segment_attention import Segments

    prefix, c1 = list(range(P)), list(range(P, P + C1))
    c2, seq = list(range(P + C1, P + C1 + C2)), list(range(P + C1 + C2, P + C1 + C2 + N3))
    pos = lambda *parts: [p for part in parts for p in part]  # noqa: E731

    def rows(tokens, positions, width):
        return ([t + [-1] * (width - len(t)) for t in tokens], [p + [0] * (width - len(p)) for p in positions])

    padded = rows([prefix + c1, prefix + c2, seq], [list(range(P + C1)), list(range(P + C2)), list(range(N3))],
                  P + C1 + 1)  # one padding column on the longest row; width even for TP 2
    group = rows([prefix + c1 + c2, seq], [pos(range(P), range(P, P + C1), range(P, P + C2)), list(range(N3))],
                 P + C1 + C2 + 1)
    packed = rows([prefix + c1 + c2 + seq], [pos(range(P), range(P, P + C1), range(P, P + C2), range(N3))],
                  P + C1 + C2 + N3 + 2)  # a tail of 2
    return {"padded": (Segments.plain([P + C1, P + C2, N3]), *padded),
            "group": (Segments(prefix=(P, N3), completions=((C1, C2), ())), *group),
            "packed": (Segments(prefix=(P, N3), completions=((C1, C2), ()), packed=True), *packed)}


def build_mla(cfg: dict, hf_state: dict, tp: int, rank: int, replicated_kv_down: bool = True):
    """Megatron's MLASelfAttention (local spec, SegmentAttention core, kv_down replicated as model.py builds it)
    loaded from transformers' state dict by MLA_NAME_RULES, this rank's TP shard. replicated_kv_down False:
    Megatron's own column-parallel kv_down (the bug compat/megatron_mla_tp_grad.py works around)."""
    import re

    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer import MLATransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from gspo_ray.compat import megatron_cpu
    from gspo_ray.compat.megatron_mla_tp_grad import replicate_kv_down_projection
    from gspo_ray.compat.megatron_mla_without_te import apply_mla_te_fix
    from gspo_ray.trainer.attention.mla import MLA_NAME_RULES, mla_options
    from gspo_ray.trainer.model import SegmentAttention

    megatron_cpu.apply()
    apply_mla_te_fix()
    config = MLATransformerConfig(
        num_layers=1, hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"],
        ffn_hidden_size=cfg["intermediate_size"], **mla_options(cfg, "config.json"), qk_layernorm=True,
        layernorm_epsilon=cfg["rms_norm_eps"], normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, apply_rope_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1, use_cpu_initialization=True,
        params_dtype=torch.float32)
    layer = specs.get_gpt_layer_local_spec(qk_layernorm=True, multi_latent_attention=True, normalization="RMSNorm")
    spec = layer.submodules.self_attention
    spec.submodules.core_attention = ModuleSpec(module=SegmentAttention, params={"kernel": "sdpa"})
    if replicated_kv_down:
        replicate_kv_down_projection(spec.submodules)
    module = build_module(spec, config=config, layer_number=1)
    shards = {}
    for name, param in module.named_parameters():
        full = "decoder.layers.0.self_attention." + name
        rule = next(r for r in MLA_NAME_RULES if re.fullmatch(r[0], full))
        tensor = hf_state[rule[1][0].replace("model.layers.{i}.self_attn.", "")]
        shard = "col" if name.startswith("linear_kv_down_proj") and not replicated_kv_down else rule[3]
        dim = {"col": 0, "row": 1}.get(shard)
        tensor = tensor if dim is None else tensor.chunk(tp, dim)[rank]
        param.data.copy_(tensor)
        shards[name] = shard
    return module, shards


def run_layout(module, layout, x_tokens, weights, tp: int, rank: int):
    """Forward one layout (inputs gathered from the logical tokens), the weighted loss backward; returns outputs
    per logical token [T, hidden] (summed where a token repeats), the input gradient per logical token, the
    loss and the parameter gradients (this rank's shards)."""
    from gspo_ray.compat.megatron_rope_positions import rope_positions

    segs, index, positions = layout
    index, positions = torch.tensor(index), torch.tensor(positions)
    x = torch.where(index[..., None] >= 0, x_tokens[index.clamp(min=0)], 0.0).transpose(0, 1)  # [S, B, H]
    w = torch.where(index[..., None] >= 0, weights[index.clamp(min=0)], 0.0).transpose(0, 1)
    x = x.chunk(tp, 0)[rank].clone().requires_grad_(True)  # sequence parallel: this rank's slice of the sequence
    module.zero_grad(set_to_none=True)
    with rope_positions(module, positions):
        out, _ = module(x, segs)
    loss = (out * w.chunk(tp, 0)[rank]).sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
    return {"out": out.detach(), "x_grad": x.grad.detach(), "loss": loss.detach(), "grads": grads,
            "index": index.transpose(0, 1).chunk(tp, 0)[rank]}


def _scenario(rank, world_size, ports, cases, rdzv):
    from megatron.core import parallel_state

    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed

    out = {}
    if rank == 0:  # 1 process: a world of its own
        init_distributed(0, 1, "", 0, init_method=f"file://{rdzv}/single")
        for name, (cfg, state, x, w) in cases.items():
            module, _ = build_mla(cfg, state, 1, 0)
            out[(name, "names")] = [n for n, _ in module.named_parameters()]
            out[(name, 1)] = {k: run_layout(module, lay, x, w, 1, 0) for k, lay in layouts().items()}
        destroy_distributed()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    init_distributed(rank, world_size, "", 0, tp=2, init_method=f"file://{rdzv}/pair")
    for name, (cfg, state, x, w) in cases.items():
        module, shards = build_mla(cfg, state, 2, rank)
        out[(name, 2)] = {k: run_layout(module, lay, x, w, 2, rank) for k, lay in layouts().items()
                          if k != "group"}
        out[(name, "shards")] = shards
        if name == "lora_rope":  # Megatron's column-parallel kv_down, padded rows: the bug still there?
            module, shards = build_mla(cfg, state, 2, rank, replicated_kv_down=False)
            out[("column_kv_down", 2)] = {"padded": run_layout(module, layouts()["padded"], x, w, 2, rank)}
            out[("column_kv_down", "shards")] = shards
    destroy_distributed()
    return out


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the larger of 1 and the reference's largest magnitude (fp32 sums of
    O(10) values differ in their last bits: 1e-5 absolute on such values is a few ulps)."""
    return float((got - want).abs().max()) / max(1.0, float(want.abs().max()))


def per_token(result, tokens: int):
    """Outputs and input gradients of a layout, summed per logical token (a repeated prefix token: its rows')."""
    out = torch.zeros(tokens, result["out"].shape[-1])
    grad = torch.zeros_like(out)
    index = result["index"].reshape(-1)
    keep = index >= 0
    out.index_add_(0, index[keep], result["out"].reshape(-1, out.shape[1])[keep])
    grad.index_add_(0, index[keep], result["x_grad"].reshape(-1, out.shape[1])[keep])
    return out, grad


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cases, hf = {}, {}
    tokens = P + C1 + C2 + N3
    for name in CONFIGS:
        cfg, attn, rope = hf_attention(name)
        g = torch.Generator().manual_seed(1)
        x, w = torch.randn(tokens, cfg.hidden_size, generator=g), torch.randn(tokens, cfg.hidden_size, generator=g)
        w[:P] = 0.0  # prefix tokens carry no loss (each layout then has the same loss)
        cases[name] = (cfg.to_dict(), {k: v.detach().clone() for k, v in attn.state_dict().items()}, x, w)
        seqs = [list(range(P)) + list(range(P, P + C1)), list(range(P)) + list(range(P + C1, P + C1 + C2)),
                list(range(P + C1 + C2, tokens))]
        hf[name] = [(s, hf_outputs(attn, rope, x[s])) for s in seqs]
    got = run_ranks(_scenario, world_size=2, args=(cases, str(tmp_path_factory.mktemp("mla_rdzv"))))
    return got, hf


@pytest.mark.parametrize("name", list(CONFIGS))
def test_padded_rows_equal_transformers(results, name):
    __tracebackhide__ = True
    got, hf = results
    res = got[0][(name, 1)]["padded"]
    out = res["out"]  # [S, B, H]
    for row, (seq, want) in enumerate(hf[name]):
        diff = rel_diff(out[:len(seq), row], want)
        assert diff < TOL, f"{name} row {row}: Megatron MLA vs transformers {diff:.2e}"
    assert not out[P + C2:, 1].any() and not out[N3:, 2].any()  # padding outputs 0


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("layout", ["group", "packed"])
def test_group_and_packed_rows_equal_padded_rows(results, name, layout):
    got, _ = results
    base, res = got[0][(name, 1)]["padded"], got[0][(name, 1)][layout]
    tokens = P + C1 + C2 + N3
    want_out, want_grad = per_token(base, tokens)
    got_out, got_grad = per_token(res, tokens)
    # a prefix token's output appears twice among the padded rows and once here: compare the completions and the
    # sequence token by token, the prefix against half the padded sum (both padded rows compute it alike)
    assert rel_diff(got_out[P:], want_out[P:]) < TOL
    assert rel_diff(got_out[:P], want_out[:P] / 2) < TOL
    assert rel_diff(got_grad, want_grad) < TOL  # a prefix token's input gradient: the sum over both completions
    assert rel_diff(res["loss"], base["loss"]) < TOL
    for pname, g in base["grads"].items():
        diff = rel_diff(res["grads"][pname], g)
        assert diff < TOL, f"{name} {layout}: gradient of {pname} differs by {diff:.2e} (relative)"


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_tp2_sequence_parallel_equals_one_process(results, name, layout):
    got, _ = results
    single = got[0][(name, 1)][layout]
    ranks = [got[r][(name, 2)][layout] for r in range(2)]
    shards = got[0][(name, "shards")]
    out = torch.cat([r["out"] for r in ranks], 0)  # sequence parallel: each rank holds half the sequence
    assert rel_diff(out, single["out"]) < TOL
    assert rel_diff(torch.cat([r["x_grad"] for r in ranks], 0), single["x_grad"]) < TOL
    assert rel_diff(sum(r["loss"] for r in ranks), single["loss"]) < TOL
    for pname, g in single["grads"].items():
        parts = [r["grads"][pname] for r in ranks]
        shard = shards[pname]
        merged = torch.cat(parts, {"col": 0, "row": 1}[shard]) if shard in ("col", "row") else sum(parts)
        diff = rel_diff(merged, g)
        assert diff < TOL, f"{name} {layout} TP 2: gradient of {pname} ({shard}) differs by {diff:.2e}"


def test_column_parallel_kv_down_still_loses_rope_gradients(results):
    """compat/megatron_mla_tp_grad.py is still needed: with Megatron's column-parallel linear_kv_down_proj, TP 2 + SP
    gives the forward right, but the rope rows of its gradient (and the input gradient) wrong."""
    got, _ = results
    single = got[0][("lora_rope", 1)]["padded"]
    ranks = [got[r][("column_kv_down", 2)]["padded"] for r in range(2)]
    assert got[0][("column_kv_down", "shards")]["linear_kv_down_proj.weight"] == "col"
    assert rel_diff(torch.cat([r["out"] for r in ranks], 0), single["out"]) < TOL
    merged = torch.cat([r["grads"]["linear_kv_down_proj.weight"] for r in ranks], 0)
    want = single["grads"]["linear_kv_down_proj.weight"]
    lora = 32  # kv_lora_rank: rows below are right, the rope rows after it are not
    assert rel_diff(merged[:lora], want[:lora]) < TOL
    assert rel_diff(merged[lora:], want[lora:]) > 1e-2, \
        "Megatron's column-parallel MLA kv_down now back-propagates the rope key right: drop the workaround"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_names_are_param_names_mla_list(results, name):
    """weights/param_names.py lists an MLA layer's parameters (attention/mla.py's mla_param_names) as built."""
    from gspo_ray.trainer.attention.mla import mla_options, mla_param_names

    got, _ = results
    assert got[0][(name, "names")] == mla_param_names(mla_options(hf_config(name).to_dict(), "config.json"))
