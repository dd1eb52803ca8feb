"""trainer.shared_prefix and trainer.packed_rows: one train step on group rows [prompt | c_1 | ... | c_G], and one
on packed rows [s_1 | s_2 | ... | tail], equals the step on padded rows.

Every layout runs on attention by segment (trainer/attention/segment_attention.py, the layer spec's core attention): a
group row as a prefix segment and G completion segments, a padded row as one segment, a packed row as its sequences (or
group rows) one after another, each attending within itself, positions from 0 in each.

For ragged groups (G in {1, 2, 8}, prompts of 1-9 tokens, completions of 0-7, some completions fully masked, an
empty completion, a one-token sequence, one prompt group of identical completions) each layout builds the worker
for "off" (padded rows: shared_prefix and packed_rows off), "on" (group rows, packed into one row per micro-batch
as by default; padded group rows at EP 2) and, at 1 process, DP 2 and TP 2 + SP, "packed" (packed rows, no
sharing), and compares each with "off": old log-probs (`compute_logprobs`), the step's loss, and every parameter's
reduced gradient (Megatron DDP's `main_grad` after the step, grad clipping off so the optimizer leaves it as
reduced). fp32; tolerance 1e-5 relative (measured: see the asserts' messages). Layouts: 1 process (dense qwen2
with a KL term to a reference model, MoE qwen3_moe), DP=2, TP=2+SP, EP=2 (MoE), TP=2+SP x EP=2 (MoE), DP=4 (also
against the 1-process step; the MoE case pack-starved like deploy/kuberay/rayjob.yaml).
"""
from __future__ import annotations

import pytest
import torch

from _spawn import algo_cfg, run_ranks, trainer_cfg
from gspo_ray.trainer.parallel import free_port

TOL = 1e-5
# (name, tp, ep, archs, runs): EP needs experts; runs: the layouts compared with "off" (padded rows). "on" is
# group rows packed into one row (the default), "on_padded" group rows in padded rows (packed_rows off), "packed"
# packed rows without sharing
LAYOUTS = [("dp2", 1, 1, ("qwen2", "qwen3_moe"), ("on", "packed")),
           ("tp2_sp", 2, 1, ("qwen2", "qwen3_moe"), ("on", "packed")),
           ("ep2", 1, 2, ("qwen3_moe",), ("on_padded",)), ("tp2_sp_ep2", 2, 2, ("qwen3_moe",), ("on",))]
RUNS = {"off": (False, False), "on": (True, True), "on_padded": (True, False), "packed": (False, True)}


def ragged_groups(vocab: int, seed: int = 0):
    """A TrainBatch of prompt groups of 8, 2, 1, 1 and 8 completions (20 rows, so DP=2 needs no padding row),
    prompts 2-9 tokens, completions 1-7; every third completion of the first group and one of the second are fully
    masked, the first group's last completion is empty. Edge cases of attention by segment: the second group's
    prompt is one token and its completions differ from their first token (a one-token prefix); the third and
    fourth are groups of one, the fourth a one-token sequence (a one-token prompt, an empty completion: a unit of
    one token in a packed row); the last holds 8 identical completions (the prefix covers them whole: 8 empty
    segments)."""
    from gspo_ray.data.records import Sample, collate

    g = torch.Generator().manual_seed(seed)
    samples, advs = [], []
    for q, size in enumerate((8, 2, 1, 1, 8)):
        prompt = torch.randint(3, vocab, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
        if q in (1, 3):
            prompt = prompt[:1]
        same = torch.randint(3, vocab, (4,), generator=g).tolist()
        for j in range(size):
            c = int(torch.randint(1, 8, (1,), generator=g))
            comp = same if q == 4 else torch.randint(3, vocab, (c,), generator=g).tolist()
            if q == 0 and j % 2 == 1:
                comp[0] = 3  # a shared first completion token for some rows: the prefix may reach into completions
            if q == 1:
                comp[0] = 3 + j  # the two rows differ right after the one-token prompt
            if (q, j) in ((0, 7), (3, 0)):
                comp = []  # an empty completion; in the fourth group, a one-token sequence
            masked = (q == 0 and j % 3 == 2) or (q == 1 and j == 0)
            n = len(comp)
            samples.append(Sample(prompt_uid=f"q{q}", sample_index=j, prompt_ids=prompt, completion_ids=comp,
                                  logprobs=[0.0] * n, loss_mask=[0 if masked else 1] * n, versions=[0] * n,
                                  finish_reason="stop"))
            advs.append([float(torch.randn(1, generator=g))] * n)
    return collate(samples, advs)


def _one_step(rank, world_size, port, model_dir, batch, run, tp, ep, beta, drift=False, mbs=6):
    from gspo_ray.trainer.worker import TrainerWorker

    shared, packed = RUNS[run]
    # drift runs take a large step and a second one, so routing moves and drift has something to count
    # the plain optimizer: its all-reduce leaves every rank's main_grad whole (the distributed one, the default
    # above DP 1, reduce-scatters: each rank's buffer holds only its own slice reduced)
    tcfg = trainer_cfg(world_size, tp=tp, ep=ep, micro_batch_size=mbs, grad_clip=0.0, lr=0.05 if drift else 1e-3,
                       shared_prefix=shared, packed_rows=packed, routing_drift=drift, router_churn_every=1,
                       use_distributed_optimizer=False)
    w = TrainerWorker(rank, world_size, "127.0.0.1", port, model_dir, tcfg, algo_cfg(beta=beta))
    plan = w._plan(batch, policy_routing=False)
    rows = sum(r >= 0 for mb in plan for r in mb.rows)  # this rank's real rows
    # (rows, width, real tokens) of each forwarded layout; None: padded rows
    widths = [(*mb.layout.tokens.shape, int(mb.layout.lengths.sum())) if mb.layout is not None else None
              for mb in plan]
    units = [mb.layout.segments.completions for mb in plan if mb.layout is not None]  # segments per unit
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
            "rows": rows, "widths": widths, "segment_units": units,
            **extra}


def _compare(rank, world_size, ports, cases, drift_case=None):
    """cases: [(model_dir, batch, tp, ep, beta, runs[, micro_batch_size])]: each run padded ("off"), then in each of
    `runs` (RUNS' names). drift_case: the index of a case also run with routing drift on, off and on."""
    out, port = [], ports[0]
    for i, (model_dir, batch, tp, ep, beta, runs, *mbs) in enumerate(cases):
        size = mbs[0] if mbs else 6
        res = {"off": _one_step(rank, world_size, port, model_dir, batch, "off", tp, ep, beta, mbs=size)}
        port = res["off"]["next_port"]
        for run in runs:
            res[run] = _one_step(rank, world_size, port, model_dir, res["off"]["batch"], run, tp, ep, beta, mbs=size)
            port = res[run]["next_port"]
        out.append(res)
        if i == drift_case:
            for name, run in (("drift_off", "off"), ("drift_on", "on")):
                out[-1][name] = _one_step(rank, world_size, port, model_dir, res["off"]["batch"], run, tp, ep, beta,
                                          True)
                port = out[-1][name]["next_port"]
    return out


@pytest.fixture(scope="module")
def results(tiny_qwen2_dir, tiny_moe_dir):
    """{(layout, arch): {"off": ..., "on": ...} per rank}."""
    dirs, vocab = {"qwen2": str(tiny_qwen2_dir), "qwen3_moe": str(tiny_moe_dir)}, {"qwen2": 23, "qwen3_moe": 22}
    single = [(dirs[a], ragged_groups(vocab[a], seed=i), 1, 1, 0.04 if a == "qwen2" else 0.0, ("on", "packed"))
              for i, a in enumerate(("qwen2", "qwen3_moe"))]
    names = [("single", a) for a in ("qwen2", "qwen3_moe")]
    out = {n: [r] for n, r in zip(names, run_ranks(_compare, 1, (single, 1))[0])}
    pairs = [(name, arch, tp, ep, runs) for name, tp, ep, archs, runs in LAYOUTS for arch in archs]
    cases = [(dirs[a], ragged_groups(vocab[a], seed=7 + i), tp, ep, 0.0, runs)
             for i, (_, a, tp, ep, runs) in enumerate(pairs)]
    ranks = run_ranks(_compare, 2, (cases,))
    for i, (name, arch, _, _, _) in enumerate(pairs):
        out[(name, arch)] = [ranks[0][i], ranks[1][i]]
    # DP 4 on the single-process batches (their padded run is the DP 1 reference), and the MoE one pack-starved
    # like deploy/kuberay/rayjob.yaml (micro_batch_size above the rows: dealing whole packs gave rank 0 everything)
    dp4 = [(d, out[("single", a)][0]["off"]["batch"], 1, 1, beta, ("on",), mbs)  # the batch with old log-probs
           for (d, _, _, _, beta, _), a, mbs in zip(single, ("qwen2", "qwen3_moe"), (6, 128))]
    ranks = run_ranks(_compare, 4, (dp4,))
    for i, arch in enumerate(("qwen2", "qwen3_moe")):
        out[("dp4", arch)] = [r[i] for r in ranks]
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


CASES = ([("single", a, run) for a in ("qwen2", "qwen3_moe") for run in ("on", "packed")]
         + [(n, a, run) for n, _, _, archs, runs in LAYOUTS for a in archs for run in runs]
         + [("dp4", "qwen2", "on"), ("dp4", "qwen3_moe", "on")])


@pytest.mark.parametrize("layout,arch,run", CASES)
def test_step_equals_padded_rows(results, layout, arch, run):
    tp = {"tp2_sp": 2, "tp2_sp_ep2": 2}.get(layout, 1)
    for rank, r in enumerate(results[(layout, arch)]):
        off, on = r["off"], r[run]
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
        if arch == "qwen3_moe":  # router churn on group / packed rows counts the rows' own tokens, like padded rows
            assert mn["moe/router_churn"] == pytest.approx(mo["moe/router_churn"], abs=1e-9)
        # the prompt is forwarded once per group row, packed rows forward no padding: fewer tokens
        assert 0 < mn["train/forward_tokens"] < mo["train/forward_tokens"], (mn["train/forward_tokens"],
                                                                            mo["train/forward_tokens"])
        assert all(w is None for w in off["widths"])
        if run != "on_padded":  # one packed row per micro-batch, padded only at its tail to a multiple of TP
            assert all(rows == 1 and width % tp == 0 and 0 <= width - real < tp
                       for rows, width, real in on["widths"]), on["widths"]


def test_packed_rows_hold_several_group_rows(results):
    """With micro_batch_size 6 the 1-process group-row plan puts more than one group row into some packed row
    (the segments of each group row offset in it), and the packed rows without sharing hold several sequences."""
    r = results[("single", "qwen2")][0]
    assert any(sum(len(cs) > 1 for cs in mb) >= 2 for mb in r["on"]["segment_units"]), r["on"]["segment_units"]
    assert max(len(mb) for mb in r["packed"]["segment_units"]) > 1


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
