"""The gpt-oss family (trainer/families/gpt_oss.py) on a tiny random GptOssForCausalLM: sliding windows of 4 on the
even layers, learned sinks, q/k/v/o biases, router and expert biases, the clamped SwiGLU (limit 7, what vLLM
computes), interleaved gate_up in HF's fused expert tensors, YaRN RoPE (factor 4, truncate
false). fp32; log-probs to 1e-5 of the largest |log-prob|, gradients to 1e-4 relative: see LOGP_REL.

One pair of spawned ranks: rank 0 first runs the 1-process checks in a world of its own (log-probs; the same model
with its windows or its sinks switched off disagrees, so both are exercised), then both ranks build the model at
TP 2 + SP and at EP 2 (log-probs), and train one step at TP 2 + SP on padded rows, group rows and packed rows
(windows restart per sequence: packed and group rows must equal padded ones, log-probs and gradients)."""
from __future__ import annotations

import pytest
import torch

from _family import (assert_rows_equal_padded, checkpoint_tensors, layout_logprobs, logprobs, maxdiff, prompt_groups,
                     router_selection_check, row_layout_steps)
from _spawn import run_ranks, trainer_cfg
from conftest import hf_logprobs, random_batch
from gspo_ray.trainer.families import FAMILIES, family_of
from gspo_ray.trainer.model_spec import spec_from_hf_config

# fp32 on a peaked model (log-probs down to -12): measured 1.03e-5 at 1 process, 1.24e-5 at TP 2 on one AMD EPYC
# host, ~1e-6 of the largest |log-prob|. Log-probs are held to LOGP_REL of the largest |log-prob| (qwen3_next's
# rule: a rounding error grows with the values summed, so the bound does not hang on one host's kernels), here
# ~1.2e-4, while a leak or a wrong window or sink moves them by more than 1e-3. Losses of group / packed rows against
# padded ones to METRIC_TOL relative; gradients relative up to 5.5e-5 measured (a router bias), held to GRAD_TOL.
LOGP_REL = 1e-5
METRIC_TOL = 2e-5
GRAD_TOL = 1e-4
VOCAB = 22


@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory):
    from gspo_ray.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model("gpt_oss", tmp_path_factory.mktemp("tiny") / "gpt_oss", seed=0, layers=3,
                                 init_std=0.3))


def logp_bound(ref) -> float:
    """The most the trainer's log-probs may differ from `ref` by: LOGP_REL of its largest |log-prob| (at least 1)."""
    return LOGP_REL * max(1.0, float(ref.abs().max()))


def oss_config(**over):
    base = dict(model_type="gpt_oss", hidden_size=64, intermediate_size=64, num_attention_heads=2,
                num_key_value_heads=2, head_dim=32, num_hidden_layers=3, vocab_size=VOCAB, num_local_experts=4,
                num_experts_per_tok=2, sliding_window=4, swiglu_limit=7.0, attention_bias=True,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
    return base | over


# ---- what the family reads and refuses (no process group) -----------------------------------------------------------
def test_the_family_states_gpt_oss_as_megatron_options():
    spec = spec_from_hf_config(oss_config(), "m")
    assert family_of("gpt_oss") is FAMILIES["gpt_oss"]
    assert (spec.moe_layers, spec.qkv_bias, spec.moe_ffn_hidden_size, spec.top_k, spec.expert_bias) == (
        (0, 1, 2), True, 64, 2, False)
    options = FAMILIES["gpt_oss"].transformer_options(spec)
    assert options.pop("activation_func").__name__ == "quick_gelu"
    assert options == dict(normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True,
                           add_bias_linear=True, add_qkv_bias=True, qk_layernorm=False,
                           activation_func_clamp_value=7.0, glu_linear_offset=1.0, softmax_type="learnable",
                           window_size=(3, 0), window_attn_skip_freq=[1, 0, 1], moe_router_score_function="softmax",
                           moe_router_pre_softmax=False)
    # transformers' default alternation when layer_types is absent: windows on even layers
    bare = {k: v for k, v in oss_config().items() if k != "layer_types"}
    assert FAMILIES["gpt_oss"].transformer_options(spec_from_hf_config(bare, "m"))["window_attn_skip_freq"] == [1, 0, 1]


@pytest.mark.parametrize("over,message", [
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]),
     r"layer_types \['chunked_attention'\] is not supported"),
    (dict(layer_types=["full_attention"]), r"layer_types \['full_attention'\] is not supported \(one entry per"),
    (dict(layer_types=["full_attention"] * 3), r"layer_types \['full_attention', 'full_attention', 'full_attention'\] "
     r"is not supported \(vLLM's gpt-oss windows exactly the even layers"),
    (dict(swiglu_limit=1.5), r"swiglu_limit 1.5 is not supported \(only 7.0"),
    (dict(sliding_window=None), r"sliding_window None must be a positive integer"),
    (dict(swiglu_alpha=1.5), r"swiglu_alpha 1.5 is not supported"),
    (dict(quantization_config={"quant_method": "mxfp4"}), r"quantization_config 'mxfp4' is not supported"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1.5e5}), r"rope_parameters.rope_type 'longrope'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 32.0}),
     r"rope_parameters.rope_type 'yarn' without rope_parameters.original_max_position_embeddings"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 32.0, "mscale": 0.7,
                           "original_max_position_embeddings": 4096}), r"rope_parameters.mscale 0.7 is not supported"),
    (dict(attention_dropout=0.1), r"attention_dropout 0.1 is not supported"),
])
def test_what_gpt_oss_cannot_be_is_refused_by_key(over, message):
    with pytest.raises(ValueError, match=message) as err:
        spec_from_hf_config(oss_config(**over), "m")
    assert "config.json" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_and_attention_factor_equal_transformers(truncate):
    """attention/yarn_rope.py against transformers' own YaRN (gpt-oss's release: factor 32, truncate false)."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from gspo_ray.trainer.attention.yarn_rope import yarn_parameters

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": truncate, "original_max_position_embeddings": 4096}
    cfg = GptOssConfig(hidden_size=64, head_dim=64, num_attention_heads=2, num_key_value_heads=2,
                       num_hidden_layers=2, rope_parameters=dict(rope))
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    got, factor = yarn_parameters(64, rope)
    assert torch.equal(got, want) and factor == pytest.approx(want_factor, rel=1e-12)
    plain = 1.0 / 150000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64)
    assert not torch.allclose(got, plain) and factor > 1.3


def test_other_families_still_refuse_layer_types_and_sinks():
    base = dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_attention_heads=2,
                num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"^m/config.json: layer_types \(per-layer attention types"):
        spec_from_hf_config(base | dict(layer_types=["sliding_attention", "full_attention"]), "m")


# ---- the spawned scenario ------------------------------------------------------------------------------------------
def _single(rdzv, oss_dir, tokens, lengths):
    from gspo_ray.trainer.model import SegmentAttention, build_model
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed
    from gspo_ray.trainer.weights.bridge import hf_state_dict_from_megatron, save_hf_checkpoint

    init_distributed(0, 1, "", 0, init_method=f"file://{rdzv}/single")
    model, spec = build_model(oss_dir)
    attention = [m for m in model.modules() if isinstance(m, SegmentAttention)]
    out = {"logp": logprobs(model, tokens, lengths), "windows": [a.window for a in attention],
           "exported": hf_state_dict_from_megatron(model, spec),
           "selection": router_selection_check(model, tokens, lengths)}
    save_hf_checkpoint(model, spec, f"{rdzv}/hf_export", tokenizer_src_dir=oss_dir)
    from gspo_ray.trainer.logprobs import forward_logprobs

    forward_logprobs(model, tokens, lengths).sum().backward()  # at 1 process: the experts' fc2 bias add under grad
    out["sink_grad"] = float(attention[0].softmax_offset.grad.abs().sum())
    for a in attention:
        a.window = None
    out["no_windows"] = logprobs(model, tokens, lengths)
    model, _ = build_model(oss_dir)
    for a in model.modules():
        if isinstance(a, SegmentAttention):
            a.softmax_offset.data.fill_(-1e4)
    out["no_sinks"] = logprobs(model, tokens, lengths)
    destroy_distributed()
    return out


def _scenario(rank, world, ports, oss_dir, tokens, lengths, batch, rdzv):
    out = {"single": _single(rdzv, oss_dir, tokens, lengths) if rank == 0 else None}
    out |= layout_logprobs(rank, world, rdzv, oss_dir, tokens, lengths, push_key="pushed")
    return out | row_layout_steps(rank, world, ports, oss_dir, batch, save=f"{rdzv}/ckpt")


@pytest.fixture(scope="module")
def runs(oss_dir, tmp_path_factory):
    tokens, lengths = random_batch(VOCAB, seed=5)
    ref, _ = hf_logprobs(oss_dir, tokens, lengths)
    root = tmp_path_factory.mktemp("oss_runs")
    ranks = run_ranks(_scenario, 2, (oss_dir, tokens, lengths, prompt_groups(), str(root)), n_ports=3)
    return {"ref": ref, "tokens": tokens, "lengths": lengths, "ranks": ranks, "root": root}


def test_export_and_pushes_hold_the_input_tensors_fused_and_transformers_loads_the_export(runs, oss_dir):
    """No update: the HF export at 1 process and the pushes at TP 2 + SP and EP 2 hold exactly the input's tensors,
    names and shapes (gpt-oss's fused, interleaved experts), and the saved export loads in transformers with the
    input's log-probs. After a step at TP 2: the offline export of its checkpoint equals what a push sent."""
    from gspo_ray.trainer.weights.hf_export import export_checkpoint

    want = checkpoint_tensors(oss_dir)
    assert "model.layers.0.mlp.experts.gate_up_proj" in want and "model.layers.0.self_attn.sinks" in want
    got = [runs["ranks"][0]["single"]["exported"]] + [r[f"{k}_pushed"] for r in runs["ranks"] for k in ("tp2_sp", "ep2")]
    for state in got:
        assert set(state) == set(want)
        for name, t in want.items():
            assert torch.equal(state[name], t), name
    ref, _ = hf_logprobs(runs["root"] / "hf_export", runs["tokens"], runs["lengths"])
    assert maxdiff(ref, runs["ref"]) == 0.0
    out = export_checkpoint(runs["root"] / "ckpt", oss_dir, runs["root"] / "offline")
    from safetensors.torch import load_file

    offline, pushed = load_file(str(out / "model.safetensors")), runs["ranks"][0]["off"]["pushed"]
    assert set(offline) == set(want) and any(not torch.equal(pushed[n], want[n]) for n in want)
    for name, t in pushed.items():
        assert torch.equal(offline[name], t), name


def test_one_process_logprobs_equal_transformers_and_need_windows_and_sinks(runs):
    single = runs["ranks"][0]["single"]
    assert int(runs["lengths"].max()) > 4  # rows longer than the window
    assert single["windows"] == [4, None, 4] and single["sink_grad"] > 0
    print(f"1 process vs transformers: {maxdiff(single['logp'], runs['ref']):.2e} "
          f"(bound {logp_bound(runs['ref']):.2e}); no windows {maxdiff(single['no_windows'], runs['ref']):.2e}, "
          f"no sinks {maxdiff(single['no_sinks'], runs['ref']):.2e}")
    assert maxdiff(single["logp"], runs["ref"]) <= logp_bound(runs["ref"])
    assert maxdiff(single["no_windows"], runs["ref"]) > 1e-3
    assert maxdiff(single["no_sinks"], runs["ref"]) > 1e-3


def test_routing_selection_includes_the_router_bias(runs):
    """routing.selection (R3's free positions, routing agreement and drift) selects as Megatron's router does, on
    logits with the router's bias; without the bias the selection would differ somewhere."""
    seen = runs["ranks"][0]["single"]["selection"]
    assert len(seen) == 3
    assert all(ours == 0 for ours, _, _ in seen) and sum(unbiased for _, unbiased, _ in seen) > 0


def test_tp2_sp_and_ep2_logprobs_equal_transformers(runs):
    ref, world = runs["ref"], 2
    for rank, r in enumerate(runs["ranks"]):
        assert maxdiff(r["tp2_sp"], ref) <= logp_bound(ref), rank
        assert maxdiff(r["ep2"], ref[rank::world]) <= logp_bound(ref), rank


@pytest.mark.parametrize("run", ["on", "packed"])
def test_group_rows_and_packed_rows_equal_padded_rows(runs, run):
    """Windows restart per sequence and never cross into another completion: the same numbers as padded rows."""
    for rank, r in enumerate(runs["ranks"]):
        off, on = r["off"], r[run]
        assert_rows_equal_padded(off, on, rank, logp_tol=logp_bound(off["logp"]), metric_tol=METRIC_TOL,  # both TP 2
                                 grad_tol=GRAD_TOL,
                                 keys=("train/loss", "train/pg_loss", "train/n_tokens"))
        assert any(n.endswith("softmax_offset") for n in off["grads"]) and any(
            n.endswith("router.bias") for n in off["grads"])


def test_context_parallelism_with_windows_or_sinks_is_refused_naming_both():
    """The preflight names trainer.cp and the config.json keys; SegmentAttention's check refuses it at construction
    too; a right-sided window or off-by-one softmax is refused by name."""
    from types import SimpleNamespace

    from gspo_ray.preflight.model import PreflightError, check_context_parallel
    from gspo_ray.trainer.attention.segment_attention import unsupported

    tcfg = trainer_cfg(2, cp=2, routing_drift=False, router_churn_every=0)
    with pytest.raises(PreflightError, match=r"^m: sliding windows / attention sinks \(config.json layer_types, "
                                             r"sliding_window, sinks\) are not built under context parallelism "
                                             r"\(trainer.cp=2\)$"):
        check_context_parallel("m", oss_config(), tcfg)
    check_context_parallel("m", oss_config(), trainer_cfg(2))  # cp 1: nothing to refuse
    assert unsupported(SimpleNamespace(context_parallel_size=2, window_size=(3, 0))) == \
        "context parallelism with sliding windows / attention sinks"
    assert unsupported(SimpleNamespace(context_parallel_size=2, softmax_type="learnable")) == \
        "context parallelism with sliding windows / attention sinks"
    assert unsupported(SimpleNamespace(window_size=(3, 2))).startswith("window_size (3, 2)")
    assert unsupported(SimpleNamespace(softmax_type="off-by-one")).startswith("softmax_type 'off-by-one'")
    assert unsupported(SimpleNamespace(window_size=(3, 0), softmax_type="learnable")) is None
