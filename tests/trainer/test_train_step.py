"""TrainerWorker.train_step: one GSPO step is the same in 1 process and split over 2 ranks (EP=2, DP=2).

The 1-process run takes the whole mini-batch (8 sequences) in 2 micro-batches of 4; the 2-rank run gives each rank
4 rows in 2 micro-batches of 2, experts split 2 + 2 over the ranks. Equal post-step log-probs prove the loss scaling
over micro-batches and DP ranks and Megatron's gradient reduction for dense and expert parameters.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from _spawn import algo_cfg, make_batch, run_ranks, trainer_cfg, with_old_logp
from gspo_ray.algo import compute_policy_loss
from gspo_ray.data.records import TrainBatch
from gspo_ray.trainer.batch_layout import loss_units, micro_batch_rows, micro_batches, split_rows
from gspo_ray.trainer.metric_accumulator import MetricAccumulator


def _scenario(rank, world_size, ports, model_dir, batch, tcfg, acfg):
    """Build a worker, set old_logp from its policy when the batch has none, take one step; post-step logp."""
    from gspo_ray.trainer.worker import TrainerWorker

    w = TrainerWorker(rank, world_size, "127.0.0.1", ports[0], model_dir, tcfg, acfg)
    logp0 = w.compute_logprobs(batch)
    if not batch.old_logp.any():
        batch = with_old_logp(batch, logp0)
    metrics = w.train_step(batch)
    logp1 = w.compute_logprobs(batch)
    out = {"batch": batch, "logp0": logp0, "metrics": metrics, "logp1": logp1, "version": w.version()}
    w.shutdown()
    if world_size == 1:  # same process, more groups: bf16 weights with a KL term to the frozen reference, and with
        out["bf16_kl"] = _bf16_kl(ports[1], model_dir, batch)  # bf16 gradient buffers
        out["bf16_grads"] = _bf16_kl(ports[2], model_dir, batch, grad_reduce_in_fp32=False)
    return out


def _bf16_kl(port, model_dir, batch, **kw):
    from gspo_ray.trainer.worker import TrainerWorker

    w = TrainerWorker(0, 1, "127.0.0.1", port, model_dir, trainer_cfg(1, dtype="bfloat16", lr=1e-3, **kw),
                      algo_cfg(beta=0.04))
    ref0 = w.compute_logprobs(batch, reference=True)
    batch = dataclasses.replace(batch, old_logp=w.compute_logprobs(batch))  # the caller's batch stays as it was
    steps = [w.train_step(batch) for _ in range(2)]
    out = {"steps": steps, "ref_moved": (w.compute_logprobs(batch, reference=True) - ref0).abs().max().item(),
           "policy_vs_ref": (w.compute_logprobs(batch) - ref0).abs().max().item(),
           "optimizers": [type(o).__name__ for o in w.optimizer.chained_optimizers],
           "param_dtype": str(next(w.gpt.parameters()).dtype),
           "grad_dtypes": sorted({str(b.grad_dtype) for b in w.ddp.buffers + w.ddp.expert_parallel_buffers}),
           "logp": w.compute_logprobs(batch)}
    w.shutdown()
    return out


@pytest.fixture(scope="module")
def runs(tiny_moe_dir):
    """(1-process result, [rank0, rank1] results of EP=2), same mini-batch and hyper-parameters."""
    acfg = algo_cfg()  # GSPO: sequence level, eps 3e-4/4e-4, seq-mean-token-mean
    model = str(tiny_moe_dir)
    single = run_ranks(_scenario, 1, (model, make_batch(8), trainer_cfg(1, micro_batch_size=4), acfg), n_ports=3)[0]
    ep2 = run_ranks(_scenario, 2, (model, single["batch"], trainer_cfg(2, ep=2, micro_batch_size=2), acfg))
    return single, ep2


def test_ep2_step_equals_single_process_step(runs):
    single, ep2 = runs
    assert (ep2[0]["logp0"] - single["logp0"]).abs().max() < 1e-5  # same starting policy
    moved = (single["logp1"] - single["logp0"]).abs().max()
    assert moved > 1e-3  # the step changed the policy, so the comparison below means something
    for r in ep2:
        assert (r["logp1"] - single["logp1"]).abs().max() <= 1e-5
        assert r["version"] == single["version"] == 1
    ms, m2 = single["metrics"], ep2[0]["metrics"]
    assert ep2[1]["metrics"]["train/loss"] == m2["train/loss"]  # metrics are reduced: equal on every rank
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/ratio_mean", "train/ratio_max",
                "train/clip_frac_seq", "train/clip_frac_tok", "train/mismatch_tok_mean", "train/mismatch_seq_max",
                "train/entropy", "train/n_tokens", "train/n_seqs", "train/lr"):
        assert m2[key] == pytest.approx(ms[key], rel=1e-4, abs=1e-6), key


def test_step_metrics_match_the_batch(runs):
    single, _ = runs
    m, batch = single["metrics"], single["batch"]
    assert m["train/n_seqs"] == 8 and m["train/n_tokens"] == float(batch.loss_mask.sum())
    # rows 1 and 2 of OLD_LOGP_SHIFT are clipped (|log s| = 0.01 >> 4e-4, on the side where A pushes): 2 of 8
    assert m["train/clip_frac_seq"] == pytest.approx(2 / 8, abs=1e-6)
    assert m["train/ratio_max"] == pytest.approx(math.exp(0.01), rel=1e-4)
    assert m["train/ratio_min"] == pytest.approx(math.exp(-0.01), rel=1e-4)
    assert 0 < m["train/mismatch_tok_mean"] < 0.01 and m["train/mismatch_seq_max"] == pytest.approx(0.01, rel=1e-2)
    assert m["train/lr"] == 1e-2 and m["train/grad_norm"] > 0 and m["train/step_s"] > 0
    assert m["train/entropy"] > 0
    # the loss is the full mini-batch GSPO loss at the pre-step policy
    loss, _ = compute_policy_loss(single["logp0"], batch.old_logp, batch.adv, batch.loss_mask.bool(), "sequence",
                                  3e-4, 4e-4)
    assert m["train/loss"] == pytest.approx(float(loss), rel=1e-5, abs=1e-7)


def test_router_churn_is_aggregated_over_ranks(runs):
    single, ep2 = runs
    ms, m2 = single["metrics"], ep2[0]["metrics"]
    for key in ("moe/router_churn_l0", "moe/router_churn_l1", "moe/router_churn"):
        assert key in ms and key in m2
        # one flipped choice out of 2 * 45 tokens would be 0.011: the runs must agree better than that
        assert m2[key] == pytest.approx(ms[key], abs=1e-9), key
    assert ms["moe/router_churn"] > 0  # lr 1e-2 moves some routing decisions


def test_bf16_step_with_kl_to_the_frozen_reference(runs):
    res = runs[0]["bf16_kl"]
    assert res["param_dtype"] == "torch.bfloat16"
    assert set(res["optimizers"]) == {"Float16OptimizerWithFloat16Params"}  # fp32 main params behind bf16 weights
    first, second = res["steps"]
    assert first["train/kl"] == 0.0  # the policy still is the reference
    assert second["train/kl"] > 0 and second["train/policy_version"] == 2.0
    assert res["ref_moved"] == 0.0 and res["policy_vs_ref"] > 0  # only the policy trains
    assert res["grad_dtypes"] == ["torch.float32"]  # trainer.grad_reduce_in_fp32's default


def test_bf16_gradient_buffers_train_the_same_steps(runs):
    """trainer.grad_reduce_in_fp32: false keeps the gradient buffers in bf16 (2 bytes a parameter less) and takes
    the same two steps as fp32 buffers, to bf16's rounding of the gradient sums."""
    fp32, bf16 = runs[0]["bf16_kl"], runs[0]["bf16_grads"]
    assert bf16["grad_dtypes"] == ["torch.bfloat16"]
    assert [s["train/step_ok"] for s in bf16["steps"]] == [1.0, 1.0] and bf16["policy_vs_ref"] > 0
    gap = (bf16["logp"] - fp32["logp"]).abs().max().item()
    assert gap < 0.01 * fp32["policy_vs_ref"], (gap, fp32["policy_vs_ref"])


# ---- the loss scaling on its own (pure torch, no Megatron) ---------------------------------------------------------
@pytest.mark.parametrize("level,aggregation", [("sequence", "seq-mean-token-mean"), ("token", "token-mean"),
                                               ("token", "seq-mean-token-sum-norm"),
                                               ("sequence_token", "seq-mean-token-mean")])
def test_scaled_micro_batch_losses_sum_to_the_mini_batch_loss(level, aggregation):
    """What train_step does: every DP rank and micro-batch backpropagates loss_mb * units_mb / units_total (x dp,
    undone by DDP's average); summed, value and gradient equal those of the whole mini-batch in one piece."""
    batch = make_batch(7, seed=3)  # 7 rows over dp=2 -> one padding row on rank 1
    g = torch.Generator().manual_seed(0)
    logp_all = (-torch.rand(batch.tokens.shape, generator=g) * 3).requires_grad_()
    batch.old_logp = torch.where(batch.loss_mask.bool(), logp_all.detach() + 0.05 * torch.randn(
        batch.tokens.shape, generator=g), 0.0)
    batch.uids = [str(i) for i in range(7)]
    kw = dict(level=level, eps_low=0.02, eps_high=0.03, aggregation=aggregation, norm_len=float(batch.tokens.shape[1]))
    full, _ = compute_policy_loss(logp_all, batch.old_logp, batch.adv, batch.loss_mask.bool(), **kw)
    (g_full,) = torch.autograd.grad(full, logp_all)

    total_units, dp, summed = loss_units(batch.loss_mask, aggregation), 2, 0.0
    row_of = {u: i for i, u in enumerate(batch.uids)}
    for dp_rank in range(dp):
        for mb in micro_batches(split_rows(batch, dp_rank, dp), 2):
            rows = torch.tensor([row_of[u] for u in mb.uids])
            logp = logp_all[rows, :mb.tokens.shape[1]]
            loss, _ = compute_policy_loss(logp, mb.old_logp, mb.adv, mb.loss_mask.bool(), **kw)
            summed = summed + loss * (loss_units(mb.loss_mask, aggregation) / total_units * dp) / dp
    (g_sum,) = torch.autograd.grad(summed, logp_all)
    assert float(summed) == pytest.approx(float(full), rel=1e-6)
    assert torch.allclose(g_sum, g_full, atol=1e-7)


def test_split_rows_pads_ranks_to_equal_rows_with_masked_copies():
    batch = make_batch(5)
    parts = [split_rows(batch, r, 2) for r in range(2)]
    assert [p.num_sequences for p in parts] == [3, 3]
    assert torch.equal(parts[0].tokens, batch.tokens[:3]) and torch.equal(parts[1].tokens[:2], batch.tokens[3:])
    assert parts[1].loss_mask[2].sum() == 0 and parts[1].adv[2].abs().sum() == 0  # the padding row trains nothing
    assert batch.loss_mask[0].sum() > 0  # the original row it copies is untouched
    mbs = micro_batches(parts[0], 2)
    assert [m.num_sequences for m in mbs] == [2, 1]
    assert all(m.tokens.shape[1] == int(m.lengths.max()) for m in mbs)


def test_micro_batch_rows_fit_the_token_cap_and_agree_across_ranks():
    batch = make_batch(5)
    longest = int(batch.lengths.max())
    assert micro_batch_rows(batch, 64, None) == 64  # no cap: rows only
    assert micro_batch_rows(batch, 64, 2 * longest + 1) == 2  # 2 rows of the longest row fit, 3 do not
    assert micro_batch_rows(batch, 1, 10 * longest) == 1  # never more than micro_batch_size
    assert micro_batch_rows(batch, 64, 1) == 1  # a row longer than the cap still trains, alone
    # derived from the whole mini-batch, so DP ranks holding different rows still run the same number of forwards
    rows = micro_batch_rows(batch, 64, 2 * longest)
    assert len({len(micro_batches(split_rows(batch, r, 2), rows)) for r in range(2)}) == 1


def test_micro_batches_keep_every_field_aligned():
    batch: TrainBatch = make_batch(4)
    batch.ref_logp = torch.randn(batch.tokens.shape)
    (mb,) = micro_batches(batch, 8)
    width = int(batch.lengths.max())
    for name in ("tokens", "loss_mask", "old_logp", "adv", "ref_logp"):
        assert torch.equal(getattr(mb, name), getattr(batch, name)[:, :width]), name


def test_metric_accumulator_weights_tokens_sequences_and_extrema():
    acc = MetricAccumulator(per_sequence_ratio=True)
    # micro-batch 1: 2 sequences, 10 tokens; micro-batch 2: 1 sequence, 2 tokens; micro-batch 3: padding only
    acc.add({"train/clip_frac_tok": 0.1, "train/clip_frac_seq": 0.5, "train/ratio_mean": 1.0, "train/ratio_max": 1.2,
             "train/ratio_min": 0.9, "train/n_tokens": 10, "train/n_seqs": 2}, n_tok=10, n_seq=2, n_units=2)
    acc.add({"train/clip_frac_tok": 0.4, "train/clip_frac_seq": 0.0, "train/ratio_mean": 2.5, "train/ratio_max": 2.5,
             "train/ratio_min": 2.5, "train/n_tokens": 2, "train/n_seqs": 1}, n_tok=2, n_seq=1, n_units=1)
    acc.add({"train/ratio_min": 0.0, "train/ratio_max": 0.0}, n_tok=0, n_seq=0, n_units=0)
    out = acc.reduce()
    assert out["train/clip_frac_tok"] == pytest.approx((0.1 * 10 + 0.4 * 2) / 12)  # token-weighted
    assert out["train/clip_frac_seq"] == pytest.approx((0.5 * 2 + 0.0 * 1) / 3)    # sequence-weighted
    assert out["train/ratio_mean"] == pytest.approx((1.0 * 2 + 2.5) / 3)          # one s per sequence
    assert (out["train/ratio_min"], out["train/ratio_max"]) == (0.9, 2.5)          # the padding batch's 0s ignored
    assert (out["train/n_tokens"], out["train/n_seqs"]) == (12, 3)


def test_lr_schedule_warms_up_from_the_first_step_then_decays():
    from gspo_ray.trainer.optim import build_optimizer_config, build_scheduler

    cfg = trainer_cfg(1, lr=1e-3, min_lr=1e-4, lr_warmup_steps=4, lr_schedule="cosine", total_steps=10,
                      weight_decay=0.1, dtype="bfloat16")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)  # the scheduler only sets param_groups
    sched = build_scheduler(opt, cfg)
    lrs = []
    for _ in range(12):
        sched.step(1)  # as optimizer_step does: advance, then step at that lr
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])   # step k of 4 warm-up steps: k/4 * lr
    assert lrs[6] == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 3 / 6)))
    assert lrs[9:] == pytest.approx([1e-4] * 3)                        # min_lr from total_steps on
    assert opt.param_groups[0]["weight_decay"] == 0.1
    ocfg = build_optimizer_config(cfg)
    assert (ocfg.optimizer, ocfg.bf16, ocfg.params_dtype, ocfg.clip_grad) == ("adam", True, torch.bfloat16, 1.0)
    assert ocfg.decoupled_weight_decay  # AdamW
    with pytest.raises(ValueError, match="total_steps"):
        build_scheduler(opt, trainer_cfg(1, lr_schedule="cosine"))
