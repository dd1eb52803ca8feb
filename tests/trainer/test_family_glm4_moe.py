"""The GLM-4.5 family (trainer/families/glm4_moe.py, the DeepSeekMoE block of families/deepseek_moe.py) on a tiny
random Glm4MoeForCausalLM with every part switched on: a dense first layer, a shared expert, q/k/v biases, QK-norm,
half-rotary RoPE, routed_scaling_factor 1.5, a non-zero router correction bias, weights of std 0.3 (peaked
log-probs: a near-uniform model would agree with a wrong converter to 1e-3), and one multi-token-prediction layer
after the decoder (models/mtp.py), which every load skips and the HF export copies unchanged.

One pair of spawned ranks: rank 0 first runs the 1-process checks in a world of its own (log-probs, the router's
selection, the parameter names, bf16, R2 and R3 after the biases moved, a checkpoint with a stray tensor), then
both ranks build the model at TP 2 + SP and at EP 2 (log-probs), train one step on padded rows, group rows and
packed rows at TP 2 + SP, train a 0-lr step at EP 2 whose weights go out as pushes do (the bucketed export and
vLLM's nccl / ipc source) and into a checkpoint, and one step with Megatron's bias update on; rank 0 then resumes the checkpoint at EP 1. Here, in the test process, the checkpoint is exported to a HF
directory (the MTP layer copied) that transformers loads. fp32; tolerance 1e-5.
"""
from __future__ import annotations

import pytest
import torch

from _family import (assert_rows_equal_padded, checkpoint_tensors, layout_logprobs, logprobs, maxdiff, prompt_groups,
                     resume_logprobs, router_selection_check, row_layout_steps)
from _spawn import algo_cfg, run_ranks, trainer_cfg
from conftest import hf_logprobs, random_batch
from gspo_ray.trainer.families import FAMILIES, family_of
from gspo_ray.trainer.model_spec import spec_from_hf_config

TOL = 1e-5
VOCAB = 22


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    from gspo_ray.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model("glm4_moe", tmp_path_factory.mktemp("tiny") / "glm4_moe", seed=0, layers=3,
                                 init_std=0.3, mtp_layers=1))


def glm_config(**over):
    base = dict(model_type="glm4_moe", hidden_size=64, intermediate_size=128, num_attention_heads=2,
                num_key_value_heads=2, head_dim=32, num_hidden_layers=3, vocab_size=VOCAB, n_routed_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1,
                n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5, attention_bias=True,
                use_qk_norm=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.5})
    return base | over


# ---- what the family reads and refuses (no process group) -----------------------------------------------------------
def test_the_family_states_glm_as_megatron_options():
    spec = spec_from_hf_config(glm_config(), "m")
    assert family_of("glm4_moe") is FAMILIES["glm4_moe"]
    assert (spec.moe_layers, spec.shared_expert_ffn_hidden_size, spec.rotary_percent, spec.qkv_bias, spec.qk_norm,
            spec.expert_bias, spec.moe_ffn_hidden_size, spec.top_k) == ((1, 2), 64, 0.5, True, True, True, 64, 2)
    options = FAMILIES["glm4_moe"].transformer_options(spec)
    options.pop("activation_func")
    assert options == dict(normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True,
                           add_bias_linear=False, add_qkv_bias=True, qk_layernorm=True,
                           moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=False,
                           moe_router_score_function="sigmoid", moe_router_dtype="fp32",
                           moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
                           moe_router_topk_scaling_factor=1.5)
    # no attention_bias / QK-norm / partial factor in config.json: none, none, and transformers' default 0.5
    bare = {k: v for k, v in glm_config().items() if k not in ("attention_bias", "use_qk_norm")}
    bare["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
    spec = spec_from_hf_config(bare, "m")
    assert (spec.qkv_bias, spec.qk_norm, spec.rotary_percent) == (False, False, 0.5)
    # DeepSeek-V3's group routing where Megatron ranks groups as transformers does (top_k / topk_group == 2)
    grouped = spec_from_hf_config(glm_config(n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2), "m")
    options = FAMILIES["glm4_moe"].router(grouped).megatron_options()
    assert (options["moe_router_num_groups"], options["moe_router_group_topk"]) == (4, 2)


@pytest.mark.parametrize("over,message", [
    (dict(norm_topk_prob=False), r"norm_topk_prob False with num_experts_per_tok 2 is not supported"),
    (dict(num_experts_per_tok=1), r"norm_topk_prob True with num_experts_per_tok 1 is not supported"),
    (dict(n_group=2, topk_group=2), r"n_group 2 / topk_group 2 with num_experts_per_tok 2 is not supported"),
    (dict(n_group=3, topk_group=1), r"n_group 3 does not divide n_routed_experts 4"),
    (dict(topk_group=2), r"topk_group 2 with n_group 1"),
    (dict(scoring_func="softmax"), r"scoring_func 'softmax' is not supported"),
    (dict(topk_method="greedy"), r"topk_method 'greedy' is not supported"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}),
     r"partial_rotary_factor 0.3 rotates 9 of head_dim 32"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), r"rope type 'yarn'"),
    (dict(mlp_bias=True), r"attention_bias/mlp_bias are not supported"),
    (dict(hidden_act="gelu"), r"hidden_act 'gelu' not supported"),
])
def test_what_glm_cannot_be_is_refused_by_key_and_value(over, message):
    with pytest.raises(ValueError, match=message) as err:
        spec_from_hf_config(glm_config(**over), "m")
    assert "config.json" in str(err.value) and "\n" not in str(err.value)


def test_a_tp_that_does_not_split_the_shared_experts_is_refused():
    with pytest.raises(ValueError, match=r"^tp=2 must divide the shared experts' width 63 \(n_shared_experts x "):
        spec_from_hf_config(glm_config(moe_intermediate_size=63), "m", tp=2)
    assert spec_from_hf_config(glm_config(n_shared_experts=0), "m", tp=2).shared_expert_ffn_hidden_size == 0


def test_other_families_refuse_what_only_glm_reads():
    base = dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_attention_heads=2,
                num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"^m/config.json: attention_bias/mlp_bias are not supported$"):
        spec_from_hf_config(base | dict(attention_bias=True), "m")
    with pytest.raises(ValueError, match=r"^m/config.json: partial_rotary_factor 0.5 is not supported by qwen3"):
        spec_from_hf_config(base | dict(partial_rotary_factor=0.5), "m")


# ---- the spawned scenario ------------------------------------------------------------------------------------------
def _replays(glm_dir, tokens, lengths, hf_routes):
    """R2 and R3 on a model whose correction biases moved after the routing was made (so its own selection differs):
    log-probs without replay, with R2's records of the first forward (made before the move), and with R3 loading
    transformers' routes of the unmoved model (the engine's stand-in). Replay replays the selection; the weights are
    the router's unbiased scores, which the bias never enters."""
    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.routing.churn import find_routers
    from gspo_ray.trainer.routing.replay import build_routing_replay

    out, keys = {}, [f"row{b}" for b in range(len(tokens))]
    for mode in ("R2", "R3"):
        model, _ = build_model(glm_dir, routing_replay=True)
        replay = build_routing_replay(model, mode)
        if mode == "R2":
            with replay.forward(keys, lengths) as action:  # first sight: records
                out["R2_recorded"], out["R2_first_action"] = logprobs(model, tokens, lengths), action.name
        else:
            replay.load(keys, hf_routes, lengths)
        g = torch.Generator().manual_seed(4)
        for _, r in find_routers(model):
            r.expert_bias += torch.randn(r.expert_bias.shape, generator=g)
        out[f"{mode}_free"] = logprobs(model, tokens, lengths)
        with replay.forward(keys, lengths) as action:
            out[mode], out[f"{mode}_action"] = logprobs(model, tokens, lengths), action.name
        replay.remove()
    return out


def _stray_error(stray_dir):
    """A checkpoint with a tensor of no place inside the decoder is refused (the MTP layer after it is skipped)."""
    from gspo_ray.trainer.model import build_model

    try:
        build_model(stray_dir)
    except ValueError as e:
        return {"stray_error": str(e)}
    return {"stray_error": None}


def _single(rdzv, glm_dir, tokens, lengths, hf_routes, stray_dir):
    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed

    init_distributed(0, 1, "", 0, init_method=f"file://{rdzv}/single")
    from gspo_ray.trainer.weights.param_names import LayerKinds, carried_buffer_names, megatron_param_names

    model, spec = build_model(glm_dir)
    out = {"logp": logprobs(model, tokens, lengths),
           "selection": router_selection_check(model, tokens, lengths, torch.sigmoid),
           "names_listed": [n for n, _ in model.named_parameters()] == megatron_param_names(spec, LayerKinds()),
           "buffers_listed": carried_buffer_names(spec),
           "buffers": sorted(n for n, _ in model.named_buffers() if n.endswith("expert_bias")),
           "bias_dtype": str(model.decoder.layers[1].mlp.router.expert_bias.dtype)}
    bf16, _ = build_model(glm_dir, dtype=torch.bfloat16)
    out["bf16"] = logprobs(bf16, tokens, lengths)
    out["bf16_dtypes"] = sorted({str(p.dtype) for p in bf16.parameters()})
    out["bf16_bias_dtype"] = str(bf16.decoder.layers[1].mlp.router.expert_bias.dtype)
    out |= _replays(glm_dir, tokens, lengths, hf_routes)
    out |= _stray_error(stray_dir)
    destroy_distributed()
    return out


def _scenario(rank, world, ports, glm_dir, tokens, lengths, hf_routes, stray_dir, batch, ckpt, rdzv):
    from gspo_ray.trainer.weights.bridge import hf_state_dict_from_megatron
    from gspo_ray.trainer.worker import TrainerWorker

    out = {"single": _single(rdzv, glm_dir, tokens, lengths, hf_routes, stray_dir) if rank == 0 else None}
    out |= layout_logprobs(rank, world, rdzv, glm_dir, tokens, lengths)
    # one step on padded rows, group rows and packed rows at TP 2 + SP (the plain optimizer: whole main_grads)
    out |= row_layout_steps(rank, world, ports, glm_dir, batch)
    # a 0-lr step at EP 2: the push's tensors and the checkpoint hold the input weights, the bias included
    w = TrainerWorker(rank, world, "127.0.0.1", ports[3], glm_dir, trainer_cfg(world, ep=2, lr=0.0, grad_clip=0.0),
                      algo_cfg())
    out["ep2_step"] = w.train_step(batch)
    out["pushed"] = hf_state_dict_from_megatron(w.gpt, w.spec)  # what a push sends (collective)
    from gspo_ray.trainer.weights.weight_send import MegatronWeightSource

    source = MegatronWeightSource(w.gpt, w.spec, bucket_bytes=2**16)  # vLLM's nccl / ipc sources (small buckets)
    out["source_meta"] = sorted(m.name for m in source.metadata())
    out["sent"] = {n: t.clone() for n, t in source}  # collective: every rank gathers (ipc's convention)
    out["ep2_logp"] = w.compute_logprobs(batch)
    w.save(ckpt)
    w.shutdown()
    # Megatron's bias update, asked for: after one step each bias moved by -rate, 0 or +rate, the same on every rank
    w = TrainerWorker(rank, world, "127.0.0.1", ports[5], glm_dir,
                      trainer_cfg(world, ep=2, lr=0.0, grad_clip=0.0, router_bias_update_rate=0.01), algo_cfg())
    w.train_step(batch)
    out["bias_updated"] = {n: b.detach().clone() for n, b in w.gpt.named_buffers() if n.endswith("expert_bias")}
    w.shutdown()
    if rank == 0:  # the EP 2 checkpoint resumed at EP 1
        out["ep1_resumed"] = resume_logprobs(ports[4], glm_dir, ckpt, batch)
    return out


def with_extra_tensor(glm_dir, out, name: str) -> str:
    """A copy of the tiny GLM whose checkpoint holds one more tensor `name` (in a second safetensors file)."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(glm_dir, out)
    save_file({name: torch.zeros(4, 4)}, str(out / "model-extra.safetensors"))
    return str(out)


def hf_selection(glm_dir, tokens, lengths) -> torch.Tensor:
    """transformers' routing of `tokens`: int16 [B, L, MoE layers, k], -1 past each length (the engine's format)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(glm_dir, dtype=torch.float32)
    picked = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, o: picked.append(o[2].detach()))
             for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    routes = torch.stack([p.reshape(*tokens.shape, -1) for p in picked], 2).to(torch.int16)
    routes[torch.arange(tokens.shape[1])[None] >= lengths[:, None]] = -1
    return routes


@pytest.fixture(scope="module")
def runs(glm_dir, tmp_path_factory):
    tokens, lengths = random_batch(VOCAB, seed=5)
    ref, entropy = hf_logprobs(glm_dir, tokens, lengths)
    batch = prompt_groups()
    root = tmp_path_factory.mktemp("glm_runs")
    hf_routes = hf_selection(glm_dir, tokens, lengths)
    stray = with_extra_tensor(glm_dir, root / "stray", "model.layers.1.mlp.gate.bias")
    ranks = run_ranks(_scenario, 2, (glm_dir, tokens, lengths, hf_routes, stray, batch, str(root / "ckpt"),
                                     str(root)), n_ports=6)
    return {"ref": ref, "entropy": entropy, "tokens": tokens, "lengths": lengths, "ranks": ranks, "batch": batch,
            "ckpt": str(root / "ckpt"), "root": root}


def test_one_process_logprobs_equal_transformers(runs):
    single = runs["ranks"][0]["single"]
    assert maxdiff(single["logp"], runs["ref"]) <= TOL
    # peaked: the random model is far from uniform (log 22 = 3.09), so a wrong converter cannot hide in 1e-5
    valid = runs["ref"] != 0
    mean_entropy = float(runs["entropy"][valid].mean())
    assert mean_entropy < 0.6 * torch.log(torch.tensor(float(VOCAB))), mean_entropy
    assert single["buffers"] == ["decoder.layers.1.mlp.router.expert_bias", "decoder.layers.2.mlp.router.expert_bias"]
    assert single["bias_dtype"] == "torch.float32"
    # param_names lists what the local spec built (shared experts after the experts) and the carried buffers
    assert single["names_listed"] and single["buffers_listed"] == single["buffers"]


@pytest.mark.parametrize("kinds", ["local", "te_grouped"])
def test_every_checkpoint_tensor_has_one_megatron_home_under_both_specs(glm_dir, kinds):
    """The Transformer Engine spec's names (fused norms, grouped GEMM experts, shared experts) map to exactly the
    checkpoint's tensors, the correction bias included, at EP 2 (pure: names only)."""
    from gspo_ray.trainer.model_spec import read_hf_config
    from gspo_ray.trainer.weights.param_names import LayerKinds, params_by_hf_name

    spec = spec_from_hf_config(read_hf_config(glm_dir), glm_dir, tp=2, ep=2)
    layer_kinds = LayerKinds(te=True, grouped_gemm=True) if kinds == "te_grouped" else LayerKinds()
    homes = params_by_hf_name(spec, layer_kinds)
    assert set(homes) == set(checkpoint_tensors(glm_dir, mtp=False))
    assert homes["model.layers.2.mlp.gate.e_score_correction_bias"] == (0, "decoder.layers.2.mlp.router.expert_bias", 0)
    assert homes["model.layers.1.mlp.shared_experts.up_proj.weight"][1:] == (
        "decoder.layers.1.mlp.shared_experts.linear_fc1.weight", 1)


def test_the_bias_is_frozen_unless_an_update_rate_is_set(runs, glm_dir):
    """rate 0 (the default): the 0-lr step's pushed bias is the input's, bit for bit (the other test); rate 0.01:
    Megatron's rule moved every layer's bias by +-0.01 per expert (0 only where an expert got exactly the mean
    load), identically on both ranks (the loads are all-reduced)."""
    want = checkpoint_tensors(glm_dir)
    moved = [r["bias_updated"] for r in runs["ranks"]]
    assert moved[0].keys() == {"decoder.layers.1.mlp.router.expert_bias", "decoder.layers.2.mlp.router.expert_bias"}
    for name, bias in moved[0].items():
        assert torch.equal(bias, moved[1][name])
        step = bias - want[f"model.layers.{name.split('.')[2]}.mlp.gate.e_score_correction_bias"]
        assert bool((((step.abs() - 0.01).abs() < 1e-6) | (step == 0)).all()), step
        assert float(step.abs().max()) == pytest.approx(0.01, abs=1e-6), step


def test_a_bf16_model_keeps_its_router_bias_fp32_and_stays_close(runs):
    """bf16 weights, the correction bias (a buffer) and the router's logits in fp32 (moe_router_dtype): log-probs
    near the fp32 reference (a routing flip on a near tie moves a token's log-prob more than bf16 rounding does)."""
    single = runs["ranks"][0]["single"]
    assert single["bf16_dtypes"] == ["torch.bfloat16"] and single["bf16_bias_dtype"] == "torch.float32"
    diff = (single["bf16"] - runs["ref"]).abs()
    assert float(diff.median()) < 0.05 and float(diff.max()) < 1.0, (float(diff.median()), float(diff.max()))


def test_multi_token_prediction_layers_are_skipped_and_other_strays_refused(runs, glm_dir):
    """Every model of this file loaded from a checkpoint with a whole MTP layer (model.layers.3.*) after its three
    decoder layers: skipped. A tensor of no place inside the decoder is refused by name."""
    mtp = set(checkpoint_tensors(glm_dir)) - set(checkpoint_tensors(glm_dir, mtp=False))
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.self_attn.q_proj.weight",
            "model.layers.3.mlp.experts.3.down_proj.weight"} <= mtp
    assert all(n.startswith("model.layers.3.") for n in mtp)
    single = runs["ranks"][0]["single"]
    assert "1 tensors have no place in the Megatron model" in single["stray_error"], single["stray_error"]
    assert "model.layers.1.mlp.gate.bias" in single["stray_error"]


def test_tp2_sp_and_ep2_logprobs_equal_transformers(runs):
    ref = runs["ref"]
    for rank, r in enumerate(runs["ranks"]):
        assert maxdiff(r["tp2_sp"], ref) <= TOL, f"tp2_sp rank {rank}"
        assert maxdiff(r["ep2"], ref[rank::2]) <= TOL, f"ep2 rank {rank}"


def test_the_router_selects_on_biased_scores_and_routing_selection_agrees(runs):
    """Megatron's router selected on sigmoid + bias at every token of every MoE layer exactly as
    routing.selection.router_topk says; the bias changed the selection at some tokens (plain top-k differs)."""
    seen = runs["ranks"][0]["single"]["selection"]
    assert len(seen) == 2 and all(ours == 0 for ours, _, _ in seen), seen
    assert sum(unbiased for _, unbiased, _ in seen) > 0, seen


def test_r2_and_r3_replay_the_selection_and_weigh_by_unbiased_scores(runs):
    """After the correction biases move, the router's own selection moves (log-probs change); R2 (the first
    forward's records) and R3 (transformers' routes of the unmoved model) give back the unmoved model's log-probs:
    the selection is replayed and the weights, unbiased scores, never depended on the bias."""
    single = runs["ranks"][0]["single"]
    assert single["R2_first_action"] == "RECORD" and single["R2_action"] == single["R3_action"] == "REPLAY_FORWARD"
    assert maxdiff(single["R2_recorded"], runs["ref"]) <= TOL
    for mode in ("R2", "R3"):
        assert maxdiff(single[f"{mode}_free"], runs["ref"]) > 1e-2, mode  # the moved bias moved the routing
        assert maxdiff(single[mode], runs["ref"]) <= TOL, mode


@pytest.mark.parametrize("run", ["on", "packed"])
def test_group_rows_and_packed_rows_equal_padded_rows(runs, run):
    for rank, r in enumerate(runs["ranks"]):
        off, on = r["off"], r[run]
        assert_rows_equal_padded(off, on, rank, logp_tol=TOL, metric_tol=TOL, grad_tol=TOL,
                                 keys=("train/loss", "train/pg_loss", "train/n_tokens"))
        assert off["metrics"]["train/loss"] != 0.0
        assert any("shared_experts" in n for n in off["grads"]) and any("linear_qkv.bias" in n for n in off["grads"])
        # expert load of the step's forwards (with router churn): the same tokens routed the same way
        for key in ("moe/expert_load_max_over_mean_l1", "moe/expert_load_max_over_mean_l2",
                    "moe/expert_load_max_over_mean"):
            assert 1.0 <= off["metrics"][key] <= 4.0 and on["metrics"][key] == pytest.approx(off["metrics"][key]), key


def test_expert_load_is_the_busiest_expert_over_the_mean():
    from gspo_ray.trainer.routing.churn import compute_expert_load

    load = torch.tensor([[6.0, 2.0, 2.0, 2.0], [3.0, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    assert compute_expert_load([1, 2, 3], load) == {"moe/expert_load_max_over_mean_l1": 2.0,
                                                    "moe/expert_load_max_over_mean_l2": 1.0,
                                                    "moe/expert_load_max_over_mean": 1.5}


def test_a_zero_lr_push_and_checkpoint_hold_the_input_weights_and_export_loads_in_transformers(runs, glm_dir):
    """The push holds the model's tensors; the export of the checkpoint holds every tensor of the input, the MTP
    layer the model skipped copied bit for bit, and transformers loads it."""
    from gspo_ray.trainer.weights.hf_export import export_checkpoint

    want, everything = checkpoint_tensors(glm_dir, mtp=False), checkpoint_tensors(glm_dir)
    assert len(everything) > len(want)
    assert any(n.endswith("e_score_correction_bias") for n in want)
    for rank, r in enumerate(runs["ranks"]):
        pushed = r["pushed"]
        assert set(pushed) == set(want), sorted(set(pushed) ^ set(want))
        assert all(torch.equal(pushed[n], want[n]) for n in want), [n for n in want if not torch.equal(pushed[n],
                                                                                                        want[n])]
        assert pushed["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
        assert r["source_meta"] == sorted(want) and all(torch.equal(r["sent"][n], want[n]) for n in want)
        assert r["ep2_step"]["train/loss"] != 0.0
    out = runs["root"] / "export"
    export_checkpoint(runs["ckpt"], glm_dir, out)
    exported = checkpoint_tensors(out)
    assert set(exported) == set(everything) and all(torch.equal(exported[n], everything[n]) for n in everything)
    import json

    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    batch = runs["batch"]
    ref = hf_logprobs(out, batch.tokens, batch.lengths)[0]
    trainer = runs["ranks"][0]["ep2_logp"]
    mask = batch.loss_mask.bool()
    assert maxdiff(trainer * mask, ref * mask) <= TOL
    # the EP 2 checkpoint resumed at EP 1 (experts and the replicated bias resharded) gives the same log-probs
    assert maxdiff(runs["ranks"][0]["ep1_resumed"], trainer) <= TOL
