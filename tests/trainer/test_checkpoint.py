"""Trainer checkpoints: save -> load on fresh ranks resumes bit-identically (EP=2, 2 ranks).

Run A: step(b1), save, step(b2). Run B (new process group, freshly built model): load, step(b2). B's log-probs,
optimizer state and second step must equal A's exactly; once with Megatron's plain optimizer and once with the
distributed (ZeRO-1) optimizer, whose state is sharded over the data-parallel ranks.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from _spawn import algo_cfg, make_batch, run_ranks, trainer_cfg
from gspo_ray.trainer.checkpoints import checkpoint as ckpt


def _opt_tensors(worker) -> list[torch.Tensor]:
    """Every tensor of the optimizer state, in a fixed order: exp_avg, exp_avg_sq, step, fp32 main params."""
    out = []
    for sub in ckpt.optimizer_state(worker.optimizer):
        for _, st in sorted(sub["inner"]["state"].items()):
            out += [st[k].clone() for k in sorted(st)]
        out += sub["main_params"]
    return out


def _resume(rank, world_size, ports, model_dir, ckpt_root, b1, b2):
    from gspo_ray.trainer.worker import TrainerWorker

    results = {}
    for i, distributed in enumerate((False, True)):
        # warm-up over 2 steps: the resumed run must also land at the same point of the LR schedule
        tcfg = trainer_cfg(2, ep=2, micro_batch_size=2, lr_warmup_steps=2, use_distributed_optimizer=distributed)
        ckpt_dir = f"{ckpt_root}/dist{int(distributed)}"
        a = TrainerWorker(rank, world_size, "127.0.0.1", ports[2 * i], model_dir, tcfg, algo_cfg())
        b1.old_logp, b2.old_logp = a.compute_logprobs(b1), a.compute_logprobs(b2)
        a.train_step(b1)
        a.save(ckpt_dir)
        saved = {"logp": a.compute_logprobs(b2), "opt": _opt_tensors(a), "rng": torch.get_rng_state()}
        a_step2, a_logp2 = a.train_step(b2), a.compute_logprobs(b2)
        a.shutdown()

        b = TrainerWorker(rank, world_size, "127.0.0.1", ports[2 * i + 1], model_dir, tcfg, algo_cfg())
        fresh = b.compute_logprobs(b2)
        if not distributed:  # the same files, as if written by Transformer Engine's layers (a copy per rank)
            other = Path(f"{ckpt_root}/te{rank}")
            shutil.copytree(ckpt_dir, other)
            meta = json.loads((other / ckpt.META).read_text())
            (other / ckpt.META).write_text(json.dumps({**meta, "layers": {"te": True, "grouped_gemm": True}}))
            b.load(other)  # read through the name map of other layers (here the names are the same): not refused
            results["other_layers"] = _opt_tensors(b)  # the weights (fp32: the main params) and moments; no forward
        version = b.load(ckpt_dir)
        loaded = {"logp": b.compute_logprobs(b2), "opt": _opt_tensors(b), "rng": torch.get_rng_state()}
        b_step2, b_logp2 = b.train_step(b2), b.compute_logprobs(b2)
        results[distributed] = dict(saved=saved, loaded=loaded, fresh=fresh, version=version, a_step2=a_step2,
                                    b_step2=b_step2, a_logp2=a_logp2, b_logp2=b_logp2, b_version=b.version())
        b.shutdown()
    return results


@pytest.fixture(scope="module")
def resumed(tiny_moe_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    ranks = run_ranks(_resume, 2, (str(tiny_moe_dir), str(root), make_batch(8, seed=11), make_batch(8, seed=12)),
                      n_ports=4)
    return ranks, root


@pytest.mark.parametrize("distributed", [False, True], ids=["adam", "distributed-adam"])
def test_resume_is_bit_identical(resumed, distributed):
    ranks, _ = resumed
    for r in ranks:
        res = r[distributed]
        assert not torch.equal(res["fresh"], res["saved"]["logp"])  # loading really replaced the weights
        assert torch.equal(res["loaded"]["logp"], res["saved"]["logp"])
        assert len(res["loaded"]["opt"]) == len(res["saved"]["opt"]) > 0
        for x, y in zip(res["loaded"]["opt"], res["saved"]["opt"]):
            assert torch.equal(x, y)
        assert torch.equal(res["loaded"]["rng"], res["saved"]["rng"])
        assert res["version"] == 1 and res["b_version"] == 2
        # the step after resume is the step without interruption
        assert torch.equal(res["b_logp2"], res["a_logp2"])
        a, b = res["a_step2"], res["b_step2"]
        assert a["train/lr"] == b["train/lr"] == pytest.approx(1e-2)  # step 2 of a 2-step warm-up: full lr
        # wall time, and how many log-prob forwards each worker ran before this step (the scenario's own calls)
        skip = lambda k: k == "train/step_s" or k.startswith("train/forward_passes_")  # noqa: E731
        assert {k: v for k, v in a.items() if not skip(k)} == {k: v for k, v in b.items() if not skip(k)}
        assert a["train/forward_passes_train"] == b["train/forward_passes_train"]  # the step itself: the same


def test_a_checkpoint_of_other_layers_is_not_refused(resumed):
    ranks, _ = resumed
    for r in ranks:
        assert len(r["other_layers"]) == len(r[False]["loaded"]["opt"]) > 0
        for x, y in zip(r["other_layers"], r[False]["loaded"]["opt"]):
            assert torch.equal(x, y)


def test_checkpoint_layout_on_disk(resumed):
    _, root = resumed
    d = root / "dist0"
    assert sorted(p.name for p in d.iterdir()) == ["meta.json", "rank_0.pt", "rank_1.pt"]
    meta = json.loads((d / "meta.json").read_text())
    assert (meta["world_size"], meta["tp"], meta["ep"], meta["version"]) == (2, 1, 2, 1)
    assert meta["layers"] == {"te": False, "grouped_gemm": False}  # what was built: the local spec here
    assert [lay["ep_rank"] for lay in meta["layouts"]] == [0, 1]
    payload = ckpt.load_rank_payload(d, 1)
    assert set(payload) == {"model", "optimizer", "scheduler", "version", "rng", "layout"}
    assert payload["scheduler"]["num_steps"] == 1
    # rank 1 holds experts 2 and 3 as its local experts 0 and 1: same names, different values than rank 0
    key = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    assert not torch.equal(payload["model"][key], ckpt.load_rank_payload(d, 0)["model"][key])


# ---- model shards from another data-parallel size (pure file logic) ------------------------------------------------
def _fake_checkpoint(tmp_path, layouts, tp=2, ep=2):
    for r, lay in enumerate(layouts):
        model = {"decoder.layers.0.self_attention.linear_qkv.weight": torch.tensor([float(r)]),
                 "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight": torch.tensor([10.0 + r])}
        torch.save({"model": model}, ckpt.rank_file(tmp_path, r))
    meta = {"world_size": len(layouts), "tp": tp, "ep": ep, "version": 3, "layouts": layouts}
    (tmp_path / ckpt.META).write_text(json.dumps(meta))


def test_model_state_is_assembled_from_matching_tp_and_ep_ranks(tmp_path):
    # saved with world 2, tp 2, ep 2: rank r is tp_rank r and ep_rank r
    _fake_checkpoint(tmp_path, [dict(tp_rank=r, ep_rank=r, etp_rank=0, pp_rank=0) for r in range(2)])
    # a rank of a larger run (world 4: dp 2) with tp_rank 0 but ep_rank 1 exists in neither saved rank alone
    sd = ckpt.load_model_state(tmp_path, dict(tp=2, ep=2, tp_rank=0, ep_rank=1, etp_rank=0, pp_rank=0))
    assert sd["decoder.layers.0.self_attention.linear_qkv.weight"].item() == 0.0      # dense from saved rank 0
    assert sd["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"].item() == 11.0  # experts from 1
    with pytest.raises(ValueError, match="ep=2.*ep=4"):
        ckpt.load_model_state(tmp_path, dict(tp=2, ep=4, tp_rank=0, ep_rank=1, etp_rank=0, pp_rank=0))


def test_incomplete_checkpoint_is_refused(tmp_path):
    torch.save({"model": {}}, ckpt.rank_file(tmp_path, 0))
    with pytest.raises(FileNotFoundError, match="meta.json"):
        ckpt.read_meta(tmp_path)
