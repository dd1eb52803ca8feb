"""HF <-> Megatron names per layer spec (trainer/weights/param_names.py, bridge.param_map): local, Transformer Engine,
and Transformer Engine with grouped-GEMM experts, on tiny dense qwen2 and qwen3_moe checkpoints (one with a dense layer
among MoE layers).

Transformer Engine cannot be built here (no CUDA), so its names are checked as names and tensors: every HF tensor
of the checkpoint is read by exactly one parameter (per EP rank), and HF -> Megatron tensors (merge_hf, in the
spec's layout) -> HF (split_to_hf) gives back every tensor bit for bit, once. The local names are checked against
the model build_model really builds (one spawned process), which also runs the dense-among-MoE model against
transformers.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from _spawn import run_ranks
from gspo_ray.trainer.weights.bridge import merge_hf, param_map, split_to_hf
from gspo_ray.trainer.model_spec import read_hf_config, spec_from_hf_config
from gspo_ray.trainer.weights.param_names import LayerKinds, hf_names_by_param, megatron_param_names, params_by_hf_name

KINDS = {"local": LayerKinds(), "te": LayerKinds(te=True), "te_grouped": LayerKinds(te=True, grouped_gemm=True)}


@pytest.fixture(scope="module")
def mixed_moe_dir(tmp_path_factory):
    """Qwen3-MoE of 3 layers whose middle layer is dense (mlp_only_layers=[1])."""
    from transformers import AutoModelForCausalLM

    from gspo_ray.models.tiny import build_config, build_tokenizer

    out = tmp_path_factory.mktemp("tiny") / "qwen3_moe_mixed"
    tokenizer = build_tokenizer()
    config = build_config("qwen3_moe", vocab_size=len(tokenizer), layers=3, eos_id=tokenizer.eos_token_id,
                          pad_id=tokenizer.pad_token_id, bos_id=tokenizer.bos_token_id)
    config.mlp_only_layers = [1]
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(tiny_qwen2_dir, tiny_moe_dir, mixed_moe_dir):
    return {"qwen2": tiny_qwen2_dir, "qwen3_moe": tiny_moe_dir, "qwen3_moe_mixed": mixed_moe_dir}


def _spec(hf_dir, ep=1):
    return spec_from_hf_config(read_hf_config(hf_dir), str(hf_dir), ep=ep)


def _cases():
    for arch in ("qwen2", "qwen3_moe", "qwen3_moe_mixed"):
        for kind in KINDS:
            for ep in (1, 2) if arch != "qwen2" else (1,):
                if kind != "te_grouped" or arch != "qwen2":  # grouped GEMM is for experts
                    yield arch, kind, ep


@pytest.mark.parametrize("arch,kind,ep", list(_cases()))
def test_every_hf_tensor_is_read_once_and_round_trips(models, arch, kind, ep):
    hf_dir = models[arch]
    spec, state = _spec(hf_dir, ep), load_file(str(hf_dir / "model.safetensors"))
    kinds = KINDS[kind]
    back = params_by_hf_name(spec, kinds)  # raises when two parameters claim one tensor
    assert set(back) == set(state)
    seen = []
    for (rank, name), hf_names in hf_names_by_param(spec, kinds).items():
        merge = param_map(name, spec.arch).merge
        full = merge_hf([state[n] for n in hf_names], merge, spec)
        for hf_name, tensor in zip(hf_names, split_to_hf(full, merge, spec)):
            assert torch.equal(tensor, state[hf_name]), hf_name
            assert back[hf_name][:2] == (rank, name)
            seen.append(hf_name)
    assert sorted(seen) == sorted(state)  # every tensor exactly once


def test_transformer_engine_names_fuse_the_norms_into_the_linears(models):
    dense, moe, mixed = (_spec(models[a]) for a in ("qwen2", "qwen3_moe", "qwen3_moe_mixed"))
    te = megatron_param_names(dense, KINDS["te"])
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in te)
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in te  # qwen2's q/k/v biases
    # an MoE layer keeps its pre-MLP norm (router and experts read it); the dense layer among them fuses it
    names = megatron_param_names(mixed, KINDS["te"])
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in names
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in names
    assert "decoder.layers.1.pre_mlp_layernorm.weight" not in names
    assert param_map("decoder.layers.1.mlp.linear_fc1.layer_norm_weight", "qwen3_moe").hf_names == (
        "model.layers.1.post_attention_layernorm.weight",)
    grouped = megatron_param_names(_spec(models["qwen3_moe"], ep=2), KINDS["te_grouped"])
    assert [n for n in grouped if n.startswith("decoder.layers.0.mlp.experts.")] == [
        "decoder.layers.0.mlp.experts.linear_fc1.weight0", "decoder.layers.0.mlp.experts.linear_fc1.weight1",
        "decoder.layers.0.mlp.experts.linear_fc2.weight0", "decoder.layers.0.mlp.experts.linear_fc2.weight1"]
    assert moe.num_local_experts == 4


def test_grouped_expert_weight_is_gate_then_up_of_its_global_expert():
    pm = param_map("decoder.layers.2.mlp.experts.linear_fc1.weight3", "qwen3_moe")
    assert (pm.merge, pm.shard, pm.local_expert) == ("gated", "none", 3)
    assert pm.for_expert(7) == ("model.layers.2.mlp.experts.7.gate_proj.weight",
                                "model.layers.2.mlp.experts.7.up_proj.weight")
    mixtral = param_map("decoder.layers.0.mlp.experts.linear_fc2.weight1", "mixtral")
    assert mixtral.for_expert(5) == ("model.layers.0.block_sparse_moe.experts.5.w2.weight",)


def test_unmapped_layouts_are_refused():
    with pytest.raises(KeyError, match="no HF mapping"):  # the legacy GroupedMLP: never built, never guessed
        param_map("decoder.layers.0.mlp.experts.weight1", "qwen3_moe")
    with pytest.raises(ValueError, match="Transformer Engine spec"):
        LayerKinds(grouped_gemm=True)


def _local_scenario(rank, world_size, ports, models, tokens, lengths):
    from gspo_ray.trainer.logprobs import forward_logprobs
    from gspo_ray.trainer.model import build_model, kernel_summary, layer_kinds
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed

    init_distributed(0, 1, "127.0.0.1", ports[0])
    out = {}
    for arch, hf_dir in models.items():
        model, spec = build_model(str(hf_dir))
        out[arch] = {"names": [n for n, _ in model.named_parameters()], "kinds": layer_kinds(model),
                     "mlps": [type(layer.mlp).__name__ for layer in model.decoder.layers],
                     "summary": kernel_summary(model)}
        if arch == "qwen3_moe_mixed":
            with torch.no_grad():
                out[arch]["logp"] = forward_logprobs(model, tokens, lengths)
    refused = []
    for kwargs in ({"attention": "te_thd"}, {"grouped_gemm": True}):  # both need the Transformer Engine spec
        try:
            build_model(str(models["qwen3_moe"]), load_weights=False, **kwargs)
        except ValueError as e:
            refused.append(str(e))
    out["refused"] = refused
    destroy_distributed()
    return out


def test_local_names_are_what_build_model_builds(models):
    """The local-spec names against the real model (so the TE names, the same list with the fused norms and
    grouped experts substituted, start from the real one), and the dense layer among MoE layers against
    transformers."""
    from conftest import hf_logprobs, random_batch

    tokens, lengths = random_batch(22)
    (built,) = run_ranks(_local_scenario, 1, (models, tokens, lengths))
    for arch, hf_dir in models.items():
        spec = _spec(hf_dir)
        assert built[arch]["names"] == megatron_param_names(spec, LayerKinds()), arch
        assert built[arch]["kinds"] == LayerKinds()
    assert built["qwen3_moe_mixed"]["mlps"] == ["MoELayer", "MLP", "MoELayer"]
    assert built["qwen3_moe"]["summary"] == {"layers": "local", "experts": "SequentialMLP", "attention": "sdpa"}
    assert built["qwen2"]["summary"]["experts"] == "-"
    assert len(built["refused"]) == 2 and all("use_te" in e for e in built["refused"])
    ref, _ = hf_logprobs(models["qwen3_moe_mixed"], tokens, lengths)
    torch.testing.assert_close(built["qwen3_moe_mixed"]["logp"], ref, rtol=0, atol=1e-5)
