"""Pipeline parallelism (trainer.pp): PP 2 = PP 1, dense and MoE, through Megatron's 1F1B schedule on gloo.

One process at PP 1 and two ranks at PP 2 (one layer per stage) take the same GSPO step on the same mini-batch in
3 micro-batches (micro_batch_size 3 of 8 rows: the schedule's warm-up, steady 1F1B and cool-down all run, with
micro-batches of different shapes): equal log-probs before, loss, metrics (the MoE's routing metrics too) and every
gradient (by global name), log-probs after. The dense model (Llama, tied embeddings) trains with a KL term to a
frozen reference, whose log-probs come from a forward-only pass of the schedule. The HF export of the PP 2 trainer (every stage's tensors gathered) equals PP 1's, and the offline
export of its checkpoint (`gspo-ray export`) equals it. Checkpoints
cross PP sizes both ways with their optimizer state: PP 1's, loaded at PP 2, and PP 2's, loaded at PP 1 (DP 2),
each take a second step equal to PP 1's own second step.
"""
from __future__ import annotations

import pytest
import torch

from _spawn import algo_cfg, make_batch, run_ranks, trainer_cfg, with_old_logp

ARCHS = ("llama", "qwen3_moe")
# the MoE's routing metrics (drift since the old log-probs, churn of the step's update: on, as by default; each
# stage watches its own layer's router, the metrics joined over the stages), equal to PP 1's
MOE_METRICS = ("moe/drift_churn", "moe/drift_churn_l0", "moe/drift_churn_l1", "moe/router_churn",
               "moe/router_churn_l0", "moe/router_churn_l1", "moe/expert_load_max_over_mean_l1", "moe/drift_tokens")


def _grads(w) -> dict[str, torch.Tensor]:
    """{global parameter name: its reduced gradient} of this rank after a step."""
    names = w._param_names()
    return {names[id(p)]: p.main_grad.detach().clone() for p in w.gpt.parameters()}


def _algo(arch):
    """The dense runs keep a KL term to a frozen reference (its log-probs a forward-only pass of the schedule)."""
    return algo_cfg(beta=0.04) if arch == "llama" else algo_cfg()


def _first_step(rank, world, port, model_dir, batch, cfg, ckpt_dir, arch):
    from gspo_ray.trainer.worker import TrainerWorker

    w = TrainerWorker(rank, world, "127.0.0.1", port, model_dir, cfg, _algo(arch))
    out = {"logp0": w.compute_logprobs(batch)}
    if not batch.old_logp.any():
        batch = with_old_logp(batch, out["logp0"])
    out |= {"batch": batch, "metrics": w.train_step(batch), "grads": _grads(w), "logp1": w.compute_logprobs(batch)}
    export = w.export_weights()
    out["hf"] = {n: t for bucket in export.buckets for n, t in bucket}
    w.save(ckpt_dir)
    return w, out


def _second_step(w, batch, ckpt_dir) -> tuple[torch.Tensor, dict]:
    """Log-probs after a step from the checkpoint, and its metrics."""
    w.load(ckpt_dir)
    metrics = w.train_step(batch)
    return w.compute_logprobs(batch), metrics


def _pp1(rank, world, ports, models, tmp):
    out = {}
    for i, (arch, model_dir) in enumerate(models.items()):
        w, out[arch] = _first_step(rank, world, ports[i], model_dir, make_batch(8), _cfg(1, arch), f"{tmp}/pp1_{arch}",
                                   arch)
        out[arch]["logp2"], out[arch]["metrics2"] = _second_step(w, out[arch]["batch"], f"{tmp}/pp1_{arch}")
        w.shutdown()
    return out


def _pp2(rank, world, ports, models, tmp, batches):
    from gspo_ray.trainer.worker import TrainerWorker

    out = {}
    for i, (arch, model_dir) in enumerate(models.items()):
        w, out[arch] = _first_step(rank, world, ports[2 * i], model_dir, batches[arch], _cfg(2, arch, pp=2),
                                   f"{tmp}/pp2_{arch}", arch)
        out[arch]["layers"] = len(w.gpt.decoder.layers)
        out[arch]["pp1_to_pp2"], out[arch]["metrics2"] = _second_step(w, batches[arch], f"{tmp}/pp1_{arch}")
        w.shutdown()
        w = TrainerWorker(rank, world, "127.0.0.1", ports[2 * i + 1], model_dir, _cfg(2, arch), _algo(arch))
        out[arch]["pp2_to_pp1"] = _second_step(w, batches[arch], f"{tmp}/pp2_{arch}")[0]
        w.shutdown()
    return out


def _cfg(world, arch, **kw):
    return trainer_cfg(world, micro_batch_size=3, **kw)


@pytest.fixture(scope="module")
def runs(tiny_llama_dir, tiny_moe_dir, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("pp"))
    models = {"llama": str(tiny_llama_dir), "qwen3_moe": str(tiny_moe_dir)}
    single = run_ranks(_pp1, 1, (models, tmp), n_ports=2)[0]
    pp2 = run_ranks(_pp2, 2, (models, tmp, {a: single[a]["batch"] for a in ARCHS}), n_ports=4)
    return single, pp2, tmp, models


@pytest.mark.parametrize("arch", ARCHS)
def test_pp2_step_equals_pp1(runs, arch):
    single, pp2 = runs[:2]
    one, stages = single[arch], [r[arch] for r in pp2]
    assert [s["layers"] for s in stages] == [1, 1]  # one layer per stage: the pipeline really splits the model
    assert (one["logp1"] - one["logp0"]).abs().max() > 1e-3  # the step moved the policy
    for s in stages:  # every stage returns the last stage's log-probs and metrics
        assert torch.equal(s["logp0"], one["logp0"])
        # after the update: the grad norm is summed over the stages in another order (a last-bit difference at most
        # in the clip factor, which Adam's normalised step can carry into more bits)
        assert (s["logp1"] - one["logp1"]).abs().max() <= 1e-5
        for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy", "train/n_tokens") + (
                MOE_METRICS if arch == "qwen3_moe" else ()):
            assert s["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-6, abs=1e-7), key
    # global names: the same as PP 1's, each layer on one stage; with tied embeddings (llama) the last stage's
    # copy of the embedding is named as the embedding and has its gradient (both stages' contributions summed)
    assert sorted(stages[0]["grads"].keys() | stages[1]["grads"].keys()) == sorted(one["grads"])
    shared = stages[0]["grads"].keys() & stages[1]["grads"].keys()
    assert shared == ({"embedding.word_embeddings.weight"} if arch == "llama" else set())
    for s in stages:
        for name, g in s["grads"].items():
            assert torch.allclose(g, one["grads"][name], rtol=1e-5, atol=1e-7), name
    assert max(g.abs().max().item() for g in one["grads"].values()) > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_pp2_export_equals_pp1(runs, arch):
    single, pp2 = runs[:2]
    hf1, hf2 = single[arch]["hf"], pp2[0][arch]["hf"]  # rank 0 holds the export
    assert sorted(hf2) == sorted(hf1)
    for name, t in hf1.items():  # after the step: equal up to the last bits of the update (see above)
        assert hf2[name].dtype == t.dtype and (hf2[name] - t).abs().max() <= 1e-6, name
    # the offline export of the PP 2 checkpoint (saved right after the export) reads every stage's rank files
    from gspo_ray.trainer.weights.hf_export import hf_tensors

    tmp, models = runs[2:]
    offline = dict(hf_tensors(f"{tmp}/pp2_{arch}", models[arch]))
    assert sorted(offline) == sorted(hf2) and all(torch.equal(offline[n], t) for n, t in hf2.items())


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoints_cross_pp_sizes(runs, arch):
    single, pp2 = runs[:2]
    want = single[arch]["logp2"]
    assert (want - single[arch]["logp1"]).abs().max() > 1e-4  # the second step moved the policy again
    for r in pp2:
        assert (r[arch]["pp1_to_pp2"] - want).abs().max() <= 1e-5
        assert (r[arch]["pp2_to_pp1"] - want).abs().max() <= 1e-5
    one, two = single[arch]["metrics2"], pp2[0][arch]["metrics2"]
    if arch == "qwen3_moe":  # the second step's drift (since the first old log-probs, weights moved): per stage
        assert one["moe/drift_churn"] > 0.05
        for key in MOE_METRICS:
            assert two[key] == pytest.approx(one[key], abs=1e-6), key
    else:  # the policy has left its reference: the KL term of the second step, from the reference's pass
        assert one["train/kl"] > 1e-4
        assert two["train/kl"] == pytest.approx(one["train/kl"], rel=1e-4)


def _pp2_tp2_ep2(rank, world, ports, model_dir, tmp, batch):
    """The MoE on 4 ranks: 2 stages x TP 2 (sequence parallel), experts over EP 2 within each stage, and every
    stage's layer recomputed in its backward (trainer.recompute full: bit for bit the step without)."""
    cfg = _cfg(4, "qwen3_moe", pp=2, tp=2, ep=2, recompute="full")
    w, out = _first_step(rank, world, ports[0], model_dir, batch, cfg, f"{tmp}/pp2tp2ep2", "qwen3_moe")
    out["layout"] = w.layout()
    out["recomputed"] = all("forward" in vars(layer) for layer in w.gpt.decoder.layers)  # checkpoint_layers' wrap
    out["pp1_to_here"] = _second_step(w, batch, f"{tmp}/pp1_qwen3_moe")[0]
    w.shutdown()
    return {k: v for k, v in out.items() if k not in ("grads", "hf", "batch")}


def test_pp2_tp2_ep2_recomputed_step_equals_pp1(runs):
    single, tmp, models = runs[0], runs[2], runs[3]
    one = single["qwen3_moe"]
    ranks = run_ranks(_pp2_tp2_ep2, 4, (models["qwen3_moe"], tmp, one["batch"]))
    assert sorted((r["layout"]["pp_rank"], r["layout"]["tp_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in ranks:
        assert r["recomputed"]
        assert (r["logp0"] - one["logp0"]).abs().max() <= 1e-5
        assert (r["logp1"] - one["logp1"]).abs().max() <= 1e-5
        assert r["metrics"]["train/loss"] == pytest.approx(one["metrics"]["train/loss"], rel=1e-4, abs=1e-6)
        assert r["metrics"]["train/grad_norm"] == pytest.approx(one["metrics"]["train/grad_norm"], rel=1e-4)
        # PP 1's checkpoint resharded over PP, TP and EP at once resumes to PP 1's own second step
        assert (r["pp1_to_here"] - one["logp2"]).abs().max() <= 1e-5
