"""The Qwen3-Next family (trainer/families/qwen3_next.py) on a tiny random Qwen3NextForCausalLM
(`make_tiny_model("qwen3_next")`: 4 layers alternating Gated DeltaNet and gated softmax attention, RoPE over a
quarter of each head, QK-norm, zero-centred norms, every MLP an MoE of 4 experts with a gated shared expert; weights
of std 0.3, norms, A_log and dt_bias perturbed), in one pair of spawned ranks: at 1 process the layers built are
the pattern's, every HF tensor is read once and the trainer's HF tensors equal the checkpoint's (the gated q_proj
merge, the shared expert and its gate, linear_attn.*); the trainer's log-probs equal transformers' for padded rows
(fp32, 1e-5 relative to the largest |log-prob|, measured ~1e-6), at EP 2 (gloo, 2 processes) too; a 0-lr step at
EP 2 on packed group rows, its push, its checkpoint (resumed at EP 1) and its HF export keep the input weights.
trainer.tp 2 / trainer.cp 2 are refused naming the field (TP of Gated DeltaNet is not built). The preflight still
refuses the family (tests/preflight/test_hybrid_preflight.py: the engine in bf16 only, no TP, routing records and
LoRA not shown)."""
from __future__ import annotations

import pytest
import torch

from _family import VOCAB, checkpoint_tensors, layout_logprobs, logprobs, prompt_groups, resume_logprobs
from _spawn import algo_cfg, run_ranks, trainer_cfg
from conftest import hf_logprobs, random_batch


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    from gspo_ray.models.tiny import make_tiny_model

    return make_tiny_model("qwen3_next", tmp_path_factory.mktemp("qwen3_next") / "model", layers=4, init_std=0.3)


def _scenario(rank, world, ports, model_dir, tokens, lengths, batch, ckpt, rdzv):
    """Rank 0 alone first (a world of its own): the layers, log-probs, the export; then both ranks at EP 2: the
    model's log-probs, and a 0-lr training step on group rows packed into one row (the Gated DeltaNet backward
    through the trainer), its push and its checkpoint; rank 0 resumes that checkpoint at EP 1."""
    from safetensors.torch import load_file

    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed
    from gspo_ray.trainer.weights.bridge import hf_state_dict_from_megatron

    out = {}
    if rank == 0:
        init_distributed(0, 1, "", 0, init_method=f"file://{rdzv}/single")
        model, spec = build_model(model_dir)
        out["layers"] = [type(layer.self_attention).__name__ for layer in model.decoder.layers]
        out["logp"] = logprobs(model, tokens, lengths)
        exported, stored = hf_state_dict_from_megatron(model, spec), load_file(f"{model_dir}/model.safetensors")
        out["export_names"] = (sorted(exported), sorted(stored))
        out["export_equal"] = all(torch.equal(exported[n].float(), stored[n].float()) for n in stored
                                  if n in exported)
        destroy_distributed()
    # EP 2: each rank holds 2 of the 4 experts and computes every row
    out |= layout_logprobs(rank, world, rdzv, model_dir, tokens, lengths, layouts=(("ep2", 1, 2),),
                           split_ep_rows=False)
    from gspo_ray.trainer.weights.weight_send import MegatronWeightSource
    from gspo_ray.trainer.worker import TrainerWorker

    w = TrainerWorker(rank, world, "127.0.0.1", ports[0], model_dir,
                      trainer_cfg(world, ep=2, lr=0.0, grad_clip=0.0, shared_prefix=True, packed_rows=True,
                                  router_churn_every=0), algo_cfg())
    out["step"] = w.train_step(batch)
    out["sent"] = {n: t.clone() for n, t in MegatronWeightSource(w.gpt, w.spec, bucket_bytes=2**16)}
    out["ep2_logp"] = w.compute_logprobs(batch)
    w.save(ckpt)
    w.shutdown()
    if rank == 0:
        out["ep1_resumed"] = resume_logprobs(ports[1], model_dir, ckpt, batch)
    return out


@pytest.fixture(scope="module")
def results(next_dir, tmp_path_factory):
    tokens, lengths = random_batch(VOCAB)
    ref, _ = hf_logprobs(next_dir, tokens, lengths)
    root = tmp_path_factory.mktemp("next_run")
    batch = prompt_groups()
    ranks = run_ranks(_scenario, world_size=2, n_ports=2,
                      args=(str(next_dir), tokens, lengths, batch, str(root / "ckpt"), str(root)))
    return ranks[0] | {"ep2_ranks": [r["ep2"] for r in ranks], "ranks": ranks, "batch": batch,
                       "ckpt": str(root / "ckpt"), "root": root}, ref


def test_the_layer_pattern_is_built(results):
    assert results[0]["layers"] == ["GatedDeltaAttention", "SelfAttention"] * 2


def test_trainer_logprobs_equal_transformers(results):
    got, ref = results
    diff = float((got["logp"] - ref).abs().max() / max(1.0, float(ref.abs().max())))
    print("relative log-prob difference", diff, "largest |log-prob|", float(ref.abs().max()))
    assert diff < 1e-5
    for logp in got["ep2_ranks"]:  # EP 2: each rank holds 2 of the 4 experts; every rank's log-probs the same
        assert float((logp - ref).abs().max() / max(1.0, float(ref.abs().max()))) < 1e-5


def test_the_exported_tensors_equal_the_checkpoint(results):
    exported, stored = results[0]["export_names"]
    assert exported == stored
    assert results[0]["export_equal"]


def test_tp_2_is_refused_by_name(next_dir):
    from gspo_ray.trainer.gated_delta.megatron_layer import refusal

    assert "trainer.tp 2" in refusal(2, 1) and "trainer.cp 2" in refusal(1, 2) and refusal(1, 1) is None
    assert all("layer_types" in refusal(*layout) for layout in ((2, 1), (1, 2)))  # both fields named


def test_a_zero_lr_step_push_checkpoint_and_export_keep_the_input_weights(results, next_dir):
    """A 0-lr step at EP 2 on packed group rows trains (a loss), its push holds the checkpoint's tensors, its
    log-probs equal transformers' on the batch; the checkpoint resumed at EP 1 gives the same log-probs; its HF
    export holds the input's tensors and transformers loads it."""
    from gspo_ray.trainer.weights.hf_export import export_checkpoint

    got, _ = results
    want = checkpoint_tensors(next_dir)
    for r in got["ranks"]:
        assert r["step"]["train/loss"] != 0.0
        assert set(r["sent"]) == set(want) and all(torch.equal(r["sent"][n], want[n]) for n in want)
    batch, trainer = got["batch"], got["ranks"][0]["ep2_logp"]
    mask = batch.loss_mask.bool()
    ref = hf_logprobs(next_dir, batch.tokens, batch.lengths)[0]
    scale = max(1.0, float(ref.abs().max()))
    assert float((trainer * mask - ref * mask).abs().max()) / scale < 1e-5
    assert float((got["ranks"][0]["ep1_resumed"] - trainer).abs().max()) / scale < 1e-5
    out = got["root"] / "export"
    export_checkpoint(got["ckpt"], next_dir, out)
    exported = checkpoint_tensors(out)
    assert set(exported) == set(want) and all(torch.equal(exported[n], want[n]) for n in want)
    assert float((hf_logprobs(out, batch.tokens, batch.lengths)[0] * mask - ref * mask).abs().max()) == 0.0
