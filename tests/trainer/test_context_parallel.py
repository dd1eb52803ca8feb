"""trainer.cp: context parallelism by segment is exact. The zig-zag split and attention of held columns
(attention/context_split.py) equal attention by segment of the whole row; and on 2 gloo ranks a train step at
CP 2 (each rank forwarding half of every row's columns, keys and values gathered over the CP group, log-probs
summed over it) equals the step at CP 1 (DP 2 on the same ranks): old log-probs (`compute_logprobs`), the step's
loss and metrics, and every parameter's reduced gradient (Megatron DDP's `main_grad`, grad clipping off), for
padded rows, group rows (packed, the default) and packed rows, dense (qwen2, with a KL term to a reference model;
group rows also under trainer.recompute full and selective, and with LoRA adapters)
and MoE (qwen3_moe); and on 4 ranks,
TP 2 with sequence parallelism x CP 2 x EP 2 (MoE) against TP 2 x DP 2 x EP 2. fp32; tolerance 1e-5 relative, as
the other layout parity tests."""
from __future__ import annotations

import pytest
import torch

from _spawn import algo_cfg, run_ranks, trainer_cfg
from test_shared_prefix_parity import ragged_groups
from gspo_ray.trainer.attention.context_split import (
    attend_columns,
    column_pairs,
    cp_columns,
    natural_order,
)
from gspo_ray.trainer.attention.segment_attention import Segments, attend_rows
from gspo_ray.trainer.parallel import free_port

TOL = 1e-5
# run -> (cp, shared_prefix, packed_rows, recompute)
RUNS = {"cp1": (1, False, False, "none"), "cp2_padded": (2, False, False, "none"),
        "cp2_group_rows": (2, True, True, "none"), "cp2_packed": (2, False, True, "none"),
        "cp2_recompute_full": (2, True, True, "full"), "cp2_recompute_selective": (2, True, True, "selective")}


@pytest.mark.parametrize("cp", [2, 3])
def test_held_columns_attend_as_the_whole_row(cp):
    """Every rank's columns (chunks r and 2 cp - 1 - r) attend exactly as those columns of the whole row: packed
    group rows with empty and long segments, padded group rows, a plain row, and padding; the ranks' query-key
    pairs add up to the rows', and on one long causal row every rank computes the same number of them."""
    torch.manual_seed(0)
    cases = [(Segments(prefix=(3, 5, 1), completions=((2, 0, 4), (), (3,)), packed=True), 24),
             (Segments(prefix=(7, 2), completions=((5, 5), (9,))), 30), (Segments.plain([48]), 48)]
    for segs, width in cases:
        width = -(-width // (2 * cp)) * 2 * cp
        q = torch.randn(width, segs.num_rows, 4, 8, dtype=torch.float64)
        k, v = (torch.randn(width, segs.num_rows, 2, 8, dtype=torch.float64) for _ in range(2))
        whole = attend_rows(q, k, v, segs)
        held = [cp_columns(width, cp, r) for r in range(cp)]
        assert sorted(torch.cat(held).tolist()) == list(range(width))  # every column on exactly one rank
        assert torch.equal(torch.cat(held)[natural_order(width, cp)], torch.arange(width))
        for cols in held:
            out = attend_columns(q[cols], k, v, segs, cols)
            assert (out - whole[cols]).abs().max() <= 1e-12, (cp, segs)
        assert sum(column_pairs(segs, cols, row) for cols in held for row in range(segs.num_rows)) == segs.pairs()
    pairs = [column_pairs(Segments.plain([48 * cp]), cp_columns(48 * cp, cp, r)) for r in range(cp)]
    assert max(pairs) == min(pairs), pairs  # one long causal row: the zig-zag gives every rank the same work
    assert sum(pairs) == Segments.plain([48 * cp]).pairs()


def _step(rank, world_size, port, model_dir, batch, run, tp, ep, beta, lora):
    from gspo_ray.config.lora import LoRAConfig
    from gspo_ray.trainer.worker import TrainerWorker

    cp, shared, packed, recompute = RUNS[run]
    tcfg = trainer_cfg(world_size, tp=tp, ep=ep, cp=cp, micro_batch_size=6, grad_clip=0.0, lr=1e-3,
                       shared_prefix=shared, packed_rows=packed, recompute=recompute, routing_drift=False,
                       router_churn_every=0, use_distributed_optimizer=False,
                       lora=LoRAConfig(rank=4) if lora else None)
    w = TrainerWorker(rank, world_size, "127.0.0.1", port, model_dir, tcfg, algo_cfg(beta=beta))
    logp = w.compute_logprobs(batch)
    if not batch.old_logp.any():  # the sampling policy, nudged per row so some ratios leave the clip band
        shift = 1e-3 * (torch.arange(batch.num_sequences)[:, None] % 3)
        batch.old_logp = torch.where(batch.loss_mask.bool(), logp - shift, 0.0)
    from gspo_ray.trainer.recompute import in_recompute

    embedded, reruns = [], []  # the tokens this rank's model forwards (its columns only under CP); attention reruns
    hooks = [w.gpt.embedding.register_forward_pre_hook(lambda m, a, kw: embedded.append(kw["input_ids"].numel()),
                                                       with_kwargs=True)]
    attention = w.gpt.decoder.layers[0].self_attention.core_attention
    hooks.append(attention.register_forward_pre_hook(lambda m, a: reruns.append(in_recompute())))
    metrics = w.train_step(batch)
    for hook in hooks:
        hook.remove()
    grads = {n: p.main_grad.detach().clone() for n, p in w.gpt.named_parameters() if p.requires_grad}
    port = [free_port() if rank == 0 else None]  # the next group's port, picked just before it is used
    torch.distributed.broadcast_object_list(port, src=0)
    w.shutdown()
    return {"logp": logp, "metrics": metrics, "grads": grads, "batch": batch, "next_port": port[0],
            "embedded": sum(embedded), "reruns": sum(reruns), "attention_recompute": attention.recompute}


def _refusals_at_cp2(rank, world_size, port, model_dirs):
    """build_model at CP 2 of each model whose layers have no column-split form: the NotImplementedError it raises
    (None: it built). CP comes from the process groups only, as in the trainer: the TransformerConfig Megatron gets
    keeps context_parallel_size 1."""
    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed

    init_distributed(rank, world_size, "127.0.0.1", port, cp=2)
    out = {}
    try:
        for name, model_dir in model_dirs.items():
            try:
                build_model(model_dir, load_weights=False)
                out[name] = None
            except NotImplementedError as e:
                out[name] = str(e)
    finally:
        destroy_distributed()
    return out


def _compare(rank, world_size, ports, cases, refused_dirs=None):
    """cases: [(model_dir, batch, tp, ep, beta, lora, runs)]: CP 1 first (its log-probs become the batch's old ones),
    then each run; beta > 0: a KL term to a reference model (its forwards under CP too); lora: adapters on the frozen
    base (trainer.lora, rank 4), their gradients compared. refused_dirs: then build those at CP 2 in the same
    processes (_refusals_at_cp2)."""
    out, port = [], ports[0]
    for model_dir, batch, tp, ep, beta, lora, runs in cases:
        res = {}
        for run in ("cp1", *runs):
            res[run] = _step(rank, world_size, port, model_dir, batch, run, tp, ep, beta, lora)
            batch, port = res[run]["batch"], res[run]["next_port"]
        out.append(res)
    if refused_dirs:
        out.append(_refusals_at_cp2(rank, world_size, port, refused_dirs))
    return out


def config_only_dirs(root) -> dict:
    """Model directories holding config.json only (build_model without weights reads nothing else): gpt-oss
    (windows and sinks), DeepSeek-V3 (multi-latent attention), Qwen3-Next (Gated DeltaNet layers)."""
    import json

    from gspo_ray.models.tiny import build_config
    from gspo_ray.models.tiny_deepseek import ENGINE_KEYS, deepseek_v3_config

    configs = {"gpt_oss": build_config("gpt_oss", 64).to_dict(),
               "qwen3_next": build_config("qwen3_next", 64).to_dict(),
               "deepseek_v3": deepseek_v3_config(64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                                                 v_head_dim=24).to_dict() | ENGINE_KEYS}
    out = {}
    for name, config in configs.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def results(tiny_qwen2_dir, tiny_moe_dir, tmp_path_factory):
    cases = [(str(tiny_qwen2_dir), ragged_groups(23, seed=3), 1, 1, 0.04, False,
              ("cp2_padded", "cp2_group_rows", "cp2_packed", "cp2_recompute_full", "cp2_recompute_selective")),
             (str(tiny_moe_dir), ragged_groups(22, seed=4), 1, 1, 0.0, False, ("cp2_group_rows", "cp2_packed")),
             (str(tiny_qwen2_dir), ragged_groups(23, seed=6), 1, 1, 0.0, True, ("cp2_group_rows",))]
    ranks = run_ranks(_compare, 2, (cases, config_only_dirs(tmp_path_factory.mktemp("cp_refused"))))
    out = {arch: [r[i] for r in ranks] for i, arch in enumerate(("qwen2", "qwen3_moe", "qwen2_lora", "refused"))}
    # 4 ranks: TP 2 with sequence parallelism x CP 2 x EP 2 (MoE) against TP 2 x DP 2 x EP 2
    moe = [(str(tiny_moe_dir), ragged_groups(22, seed=5), 2, 2, 0.0, False, ("cp2_padded", "cp2_group_rows"))]
    out["qwen3_moe_tp2_ep2"] = [r[0] for r in run_ranks(_compare, 4, (moe,))]
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


CASES = [("qwen2", "cp2_padded"), ("qwen2", "cp2_group_rows"), ("qwen2", "cp2_packed"),
         ("qwen2", "cp2_recompute_full"), ("qwen2", "cp2_recompute_selective"),
         ("qwen3_moe", "cp2_group_rows"), ("qwen3_moe", "cp2_packed"), ("qwen2_lora", "cp2_group_rows"), ("qwen3_moe_tp2_ep2", "cp2_padded"),
         ("qwen3_moe_tp2_ep2", "cp2_group_rows")]


@pytest.mark.parametrize("arch,run", CASES)
def test_cp2_step_equals_cp1(results, arch, run):
    for rank, r in enumerate(results[arch]):
        ref, cp = r["cp1"], r[run]
        assert _rel(cp["logp"], ref["logp"]) <= TOL, (rank, "logp", _rel(cp["logp"], ref["logp"]))
        for key in ("train/loss", "train/pg_loss", "train/n_tokens", "train/n_seqs", "train/entropy",
                    "train/ratio_mean", "train/clip_frac", "train/kl"):
            if key in ref["metrics"]:
                assert cp["metrics"][key] == pytest.approx(ref["metrics"][key], rel=TOL, abs=1e-9), (rank, key)
        assert ref["metrics"]["train/loss"] != 0.0
        assert ("train/kl" in ref["metrics"]) == (arch == "qwen2")
        assert len(ref["grads"]) > 0
        assert set(cp["grads"]) == set(ref["grads"])
        if arch == "qwen2_lora":  # the adapters only; at their start (B = 0) only the B factors get a gradient
            assert set(ref["grads"]) == {n for n in ref["grads"] if ".lora." in n} and len(ref["grads"]) > 0
        for name, g in ref["grads"].items():
            # every dense parameter (every adapter's B) gets a gradient
            assert g.abs().max() > 0 or "expert" in name or name.endswith(".A"), name
            assert _rel(cp["grads"][name], g) <= TOL, (rank, name, _rel(cp["grads"][name], g))
        # each CP rank embeds half of the columns the step forwards (forward_tokens: whole rows, DP 1; padded rows
        # count before their padding to a multiple of 2 x CP x TP, fewer than 8 columns a row)
        extra = 2 * cp["embedded"] - cp["metrics"]["train/forward_tokens"]
        assert (0 <= extra < 8 * 20) if run == "cp2_padded" else extra == 0, (cp["embedded"], extra)
        # full: each layer (its gather with it) runs again in the backward; selective: the attention call does
        assert (cp["reruns"] > 0) == (run == "cp2_recompute_full"), cp["reruns"]
        assert cp["attention_recompute"] == {"cp2_recompute_full": "layer",
                                             "cp2_recompute_selective": "call"}.get(run, "none")


def test_a_model_built_at_cp2_refuses_windows_sinks_mla_and_gated_deltanet(results):
    """The trainer's guards read CP from the process groups (Megatron's config is built with context_parallel_size
    1): at CP 2 a model whose attention has no column-split form is refused at construction, on every rank."""
    windows = "SegmentAttention does not cover context parallelism with sliding windows / attention sinks"
    mla = "SegmentAttention does not cover context parallelism with multi-latent attention"
    for refused in results["refused"]:  # (Megatron's build_module appends "when instantiating ...")
        assert refused["gpt_oss"] is not None and refused["gpt_oss"].startswith(windows), refused
        assert refused["deepseek_v3"] is not None and refused["deepseek_v3"].startswith(mla), refused
        assert refused["qwen3_next"] is not None and "trainer.cp 2 with Gated DeltaNet" in refused["qwen3_next"]
