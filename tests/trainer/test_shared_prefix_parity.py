"""trainer.shared_prefix: one train step on group rows [prompt | c_1 | ... | c_G] equals the step on padded rows.

Both layouts run on attention by segment (trainer/segment_attention.py, the layer spec's core attention): a group
row as a prefix segment and G completion segments, a padded row as one segment.

For ragged groups (G in {1, 2, 8}, prompts of 2-9 tokens, completions of 1-7, some completions fully masked, one
prompt group of identical completions) each layout builds the worker twice, sharing off then on, and compares:
old log-probs (`compute_logprobs`), the step's loss, and every parameter's reduced gradient (Megatron DDP's
`main_grad` after the step, grad clipping off so the optimizer leaves it as reduced). fp32; tolerance 1e-5
relative (measured: see the asserts' messages). Layouts: 1 process (dense qwen2 with a KL term to a reference
model, MoE qwen3_moe), DP=2, TP=2+SP, EP=2 (MoE), TP=2+SP x EP=2 (MoE), DP=4 (also against the 1-process step;
the MoE case pack-starved like deploy/kuberay/rayjob.yaml).
"""
from __future__ import annotations

import pytest
import torch

from _spawn import algo_cfg, run_ranks, trainer_cfg
from gspo_ray.trainer.parallel import free_port

TOL = 1e-5
# (name, tp, ep, archs): EP needs experts
LAYOUTS = [("dp2", 1, 1, ("qwen2", "qwen3_moe")), ("tp2_sp", 2, 1, ("qwen2", "qwen3_moe")),
           ("ep2", 1, 2, ("qwen3_moe",)), ("tp2_sp_ep2", 2, 2, ("qwen3_moe",))]


def ragged_groups(vocab: int, seed: int = 0):
    """A TrainBatch of prompt groups of 8, 2, 1, 1 and 8 completions (20 rows, so DP=2 needs no padding row),
    prompts 2-9 tokens, completions 1-7; every third completion of the first group and one of the second are fully
    masked. Edge cases of attention by segment: the second group's prompt is one token and its completions differ
    from their first token (a one-token prefix); the third and fourth are groups of one; the last holds 8
    identical completions (the prefix covers them whole: 8 empty segments)."""
    from gspo_ray.data.records import Sample, collate

    g = torch.Generator().manual_seed(seed)
    samples, advs = [], []
    for q, size in enumerate((8, 2, 1, 1, 8)):
        prompt = torch.randint(3, vocab, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
        if q == 1:
            prompt = prompt[:1]
        same = torch.randint(3, vocab, (4,), generator=g).tolist()
        for j in range(size):
            c = int(torch.randint(1, 8, (1,), generator=g))
            comp = same if q == 4 else torch.randint(3, vocab, (c,), generator=g).tolist()
            if q == 0 and j % 2 == 1:
                comp[0] = 3  # a shared first completion token for some rows: the prefix may reach into completions
            if q == 1:
                comp[0] = 3 + j  # the two rows differ right after the one-token prompt
            masked = (q == 0 and j % 3 == 2) or (q == 1 and j == 0)
            n = len(comp)
            samples.append(Sample(prompt_uid=f"q{q}", sample_index=j, prompt_ids=prompt, completion_ids=comp,
                                  logprobs=[0.0] * n, loss_mask=[0 if masked else 1] * n, versions=[0] * n,
                                  finish_reason="stop"))
            advs.append([float(torch.randn(1, generator=g))] * n)
    return collate(samples, advs)


def _one_step(rank, world_size, port, model_dir, batch, shared, tp, ep, beta, drift=False, mbs=6):
    from gspo_ray.trainer.worker import TrainerWorker

    # drift runs take a large step and a second one, so routing moves and drift has something to count
    # the plain optimizer: its all-reduce leaves every rank's main_grad whole (the distributed one, the default
    # above DP 1, reduce-scatters: each rank's buffer holds only its own slice reduced)
    tcfg = trainer_cfg(world_size, tp=tp, ep=ep, micro_batch_size=mbs, grad_clip=0.0, lr=0.05 if drift else 1e-3,
                       shared_prefix=shared, routing_drift=drift, router_churn_every=1, use_distributed_optimizer=False)
    w = TrainerWorker(rank, world_size, "127.0.0.1", port, model_dir, tcfg, algo_cfg(beta=beta))
    rows = sum(r >= 0 for mb in w._plan(batch, policy_routing=False) for r in mb.rows)  # this rank's real rows
    logp = w.compute_logprobs(batch)
    if not batch.old_logp.any():  # the sampling policy, nudged per row so some ratios leave the clip band
        shift = 1e-3 * (torch.arange(batch.num_sequences)[:, None] % 3)
        batch.old_logp = torch.where(batch.loss_mask.bool(), logp - shift, 0.0)
    ref = w.compute_logprobs(batch, reference=True) if beta > 0 else None
    metrics = w.train_step(batch)
    grads = {n: p.main_grad.detach().clone() for n, p in w.gpt.named_parameters()}
    extra = {}
    if drift:
        extra = {"drift_store": {k: [t.clone() for t in v] for k, v in w.drift.store.items()},
                 "second": w.train_step(batch)}
    # the next group's port, picked just before it is used (ports picked early get taken on a busy host)
    port = [free_port() if rank == 0 else None]
    torch.distributed.broadcast_object_list(port, src=0)
    w.shutdown()
    return {"logp": logp, "ref": ref, "metrics": metrics, "grads": grads, "batch": batch, "next_port": port[0],
            "rows": rows, **extra}


def _compare(rank, world_size, ports, cases, drift_case=None):
    """cases: [(model_dir, batch, tp, ep, beta[, micro_batch_size])]: each run with sharing off, then on.
    drift_case: the index of a case also run with routing drift on, sharing off and on."""
    out, port = [], ports[0]
    for i, (model_dir, batch, tp, ep, beta, *mbs) in enumerate(cases):
        off = _one_step(rank, world_size, port, model_dir, batch, False, tp, ep, beta, mbs=mbs[0] if mbs else 6)
        on = _one_step(rank, world_size, off["next_port"], model_dir, off["batch"], True, tp, ep, beta,
                       mbs=mbs[0] if mbs else 6)
        port = on["next_port"]
        out.append({"off": off, "on": on})
        if i == drift_case:
            for name, shared in (("drift_off", False), ("drift_on", True)):
                out[-1][name] = _one_step(rank, world_size, port, model_dir, off["batch"], shared, tp, ep, beta, True)
                port = out[-1][name]["next_port"]
    return out


@pytest.fixture(scope="module")
def results(tiny_qwen2_dir, tiny_moe_dir):
    """{(layout, arch): {"off": ..., "on": ...} per rank}."""
    dirs, vocab = {"qwen2": str(tiny_qwen2_dir), "qwen3_moe": str(tiny_moe_dir)}, {"qwen2": 23, "qwen3_moe": 22}
    single = [(dirs[a], ragged_groups(vocab[a], seed=i), 1, 1, 0.04 if a == "qwen2" else 0.0)
              for i, a in enumerate(("qwen2", "qwen3_moe"))]
    names = [("single", a) for a in ("qwen2", "qwen3_moe")]
    out = {n: [r] for n, r in zip(names, run_ranks(_compare, 1, (single, 1))[0])}
    pairs = [(name, arch, tp, ep) for name, tp, ep, archs in LAYOUTS for arch in archs]
    cases = [(dirs[a], ragged_groups(vocab[a], seed=7 + i), tp, ep, 0.0) for i, (_, a, tp, ep) in enumerate(pairs)]
    ranks = run_ranks(_compare, 2, (cases,))
    for i, (name, arch, _, _) in enumerate(pairs):
        out[(name, arch)] = [ranks[0][i], ranks[1][i]]
    # DP 4 on the single-process batches (their padded run is the DP 1 reference), and the MoE one pack-starved
    # like deploy/kuberay/rayjob.yaml (micro_batch_size above the rows: dealing whole packs gave rank 0 everything)
    dp4 = [(d, out[("single", a)][0]["off"]["batch"], 1, 1, beta, mbs)  # the batch with the old log-probs set
           for (d, _, _, _, beta), a, mbs in zip(single, ("qwen2", "qwen3_moe"), (6, 128))]
    ranks = run_ranks(_compare, 4, (dp4,))
    for i, arch in enumerate(("qwen2", "qwen3_moe")):
        out[("dp4", arch)] = [r[i] for r in ranks]
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


CASES = ([("single", "qwen2"), ("single", "qwen3_moe")] + [(n, a) for n, _, _, archs in LAYOUTS for a in archs]
         + [("dp4", "qwen2"), ("dp4", "qwen3_moe")])


@pytest.mark.parametrize("layout,arch", CASES)
def test_shared_prefix_step_equals_padded_rows(results, layout, arch):
    for rank, r in enumerate(results[(layout, arch)]):
        off, on = r["off"], r["on"]
        assert _rel(on["logp"], off["logp"]) <= TOL, (rank, "logp")
        if off["ref"] is not None:
            assert _rel(on["ref"], off["ref"]) <= TOL, (rank, "reference logp")
        mo, mn = off["metrics"], on["metrics"]
        for key in ("train/loss", "train/pg_loss", "train/n_tokens", "train/n_seqs", "train/entropy",
                    "train/ratio_mean", "train/kl"):
            if key in mo:
                assert mn[key] == pytest.approx(mo[key], rel=TOL, abs=1e-9), (rank, key)
        assert mo["train/loss"] != 0.0
        assert set(on["grads"]) == set(off["grads"])
        for name, g in off["grads"].items():
            assert g.abs().max() > 0 or "expert" in name, name  # every dense parameter gets a gradient
            assert _rel(on["grads"][name], g) <= TOL, (rank, name, _rel(on["grads"][name], g))
        if arch == "qwen3_moe":  # router churn on group rows counts the rows' own tokens, like padded rows
            assert mn["moe/router_churn"] == pytest.approx(mo["moe/router_churn"], abs=1e-9)
        # the prompt is forwarded once per group row: fewer tokens
        assert 0 < mn["train/forward_tokens"] < mo["train/forward_tokens"], (mn["train/forward_tokens"],
                                                                            mo["train/forward_tokens"])


def test_routing_drift_on_group_rows_equals_padded_rows(results):
    """Routing drift reads each row's tokens out of the group rows: the records it stores per row, and the drift
    it measures after an update, equal those of padded rows, while the forwards share the prompt."""
    r = results[("single", "qwen3_moe")][0]
    off, on = r["drift_off"], r["drift_on"]
    assert 0 < on["metrics"]["train/forward_tokens"] < off["metrics"]["train/forward_tokens"]
    assert _rel(on["logp"], off["logp"]) <= TOL
    assert set(on["drift_store"]) == set(off["drift_store"]) and len(off["drift_store"]) > 0
    for key, layers in off["drift_store"].items():
        assert [t.tolist() for t in on["drift_store"][key]] == [t.tolist() for t in layers], key
    assert off["second"]["moe/drift_churn"] > 0  # lr 0.05 moved the routers
    for key in [k for k in off["second"] if k.startswith("moe/drift_churn")]:
        assert on["second"][key] == pytest.approx(off["second"][key], abs=1e-9), key


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_dp4_group_rows_equal_one_process_and_share_the_rows(results, arch):
    """DP 4 with group rows: the same log-probs, metrics and reduced gradients as the 1-process padded step on the
    same batch, and every rank trains its share of the 20 rows (the MoE case pack-starved: micro_batch_size 128)."""
    single = results[("single", arch)][0]["off"]
    ranks = [r["on"] for r in results[("dp4", arch)]]
    assert all(2 <= r["rows"] <= 10 for r in ranks), [r["rows"] for r in ranks]  # balanced by cost, not count
    assert sum(r["rows"] for r in ranks) == 20
    for rank, on in enumerate(ranks):
        assert _rel(on["logp"], single["logp"]) <= TOL, (rank, "logp")
        for key in ("train/loss", "train/pg_loss", "train/n_tokens", "train/n_seqs", "train/entropy", "train/kl"):
            if key in single["metrics"]:
                assert on["metrics"][key] == pytest.approx(single["metrics"][key], rel=TOL, abs=1e-9), (rank, key)
        assert 1.0 <= on["metrics"]["train/dp_imbalance"] <= 1.5
        for name, g in single["grads"].items():
            assert _rel(on["grads"][name], g) <= TOL, (rank, name, _rel(on["grads"][name], g))
