"""Checkpoints across layouts, with the distributed optimizer on wherever DP > 1 (its default), on the tiny MoE.

Three spawns. World 2: an EP 2 (DP 2, distributed optimizer) run and a TP 2 run each take step b1, save, take step
b2 (the uninterrupted run) and save again. World 1: each of those checkpoints is loaded at DP 1 / EP 1 / TP 1 and
takes step b2; a fresh DP 1 run saves after b1 and goes on to b2. World 2 again: the DP 1 checkpoint is loaded at
DP 2 / EP 2 and takes b2. Each resumed step must equal the uninterrupted one: the loss and log-probs, and after the
step every weight and Adam moment (compared in the TP 1 / EP 1 layout, read from both runs' checkpoints) to the
rounding a different order of sums gives (`_assert_same_state`).
The DP 2 save must write each parameter's and moment's bytes once.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _spawn import algo_cfg, make_batch, run_ranks, trainer_cfg
from gspo_ray.trainer.checkpoints import checkpoint as ckpt
from gspo_ray.trainer.checkpoints.shards import full_state
from tests.tolerance import assert_within_rounding

pytestmark = pytest.mark.isa  # make test-isa: floats summed by the CPU's kernels
LOSS_KEYS = ("train/loss", "train/grad_norm")
ALGO = dict(eps_low=0.2, eps_high=0.28)  # a wide band: step b2 is not clipped away after step b1


def _run(rank, world_size, port, model_dir, tcfg, batches, load=None, save_after_b1=None, save_after_b2=None,
         save_after_load=None):
    from gspo_ray.trainer.worker import TrainerWorker

    b1, b2 = batches
    w = TrainerWorker(rank, world_size, "127.0.0.1", port, model_dir, tcfg, algo_cfg(**ALGO))
    if load is not None:
        w.load(load)
        if save_after_load:
            w.save(save_after_load)
    else:
        w.train_step(b1)
        w.save(save_after_b1)
    step = w.train_step(b2)
    out = {"step": {k: step[k] for k in LOSS_KEYS}, "logp": w.compute_logprobs(b2), "version": w.version()}
    w.save(save_after_b2)
    w.shutdown()
    return out


def _world2(rank, world_size, ports, model_dir, root, b1, b2):
    from gspo_ray.trainer.worker import TrainerWorker

    # old log-probs of the initial policy, the same for every run below
    w = TrainerWorker(rank, world_size, "127.0.0.1", ports[2], model_dir, trainer_cfg(2, micro_batch_size=2),
                      algo_cfg())
    b1.old_logp, b2.old_logp = w.compute_logprobs(b1), w.compute_logprobs(b2)
    w.shutdown()
    batches = (b1, b2)
    return {
        "batches": batches,
        "ep": _run(rank, world_size, ports[0], model_dir, trainer_cfg(2, ep=2, micro_batch_size=2), batches,
                   save_after_b1=f"{root}/ep2", save_after_b2=f"{root}/ep2_next"),
        "tp": _run(rank, world_size, ports[1], model_dir, trainer_cfg(2, tp=2, micro_batch_size=2), batches,
                   save_after_b1=f"{root}/tp2", save_after_b2=f"{root}/tp2_next"),
    }


def _world1(rank, world_size, ports, model_dir, root, batches):
    tcfg = trainer_cfg(1, micro_batch_size=2)
    return {
        "ep": _run(rank, world_size, ports[0], model_dir, tcfg, batches, load=f"{root}/ep2",
                   save_after_load=f"{root}/ep2_as1", save_after_b2=f"{root}/ep2_resumed"),
        "tp": _run(rank, world_size, ports[1], model_dir, tcfg, batches, load=f"{root}/tp2",
                   save_after_load=f"{root}/tp2_as1", save_after_b2=f"{root}/tp2_resumed"),
        "one": _run(rank, world_size, ports[2], model_dir, tcfg, batches, save_after_b1=f"{root}/dp1",
                    save_after_b2=f"{root}/dp1_next"),
    }


def _world2_from_1(rank, world_size, ports, model_dir, root, batches):
    return _run(rank, world_size, ports[0], model_dir, trainer_cfg(2, ep=2, micro_batch_size=2), batches,
                load=f"{root}/dp1", save_after_b2=f"{root}/dp1_resumed")


@pytest.fixture(scope="module")
def runs(tiny_moe_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    args = (str(tiny_moe_dir), str(root))
    two = run_ranks(_world2, 2, args + (make_batch(8, seed=21), make_batch(8, seed=22)), n_ports=3)
    batches = two[0]["batches"]
    one = run_ranks(_world1, 1, args + (batches,), n_ports=3)[0]
    back = run_ranks(_world2_from_1, 2, args + (batches,), n_ports=1)
    return root, two, one, back


def _full_state(ckpt_dir: Path, model_dir) -> dict[str, dict[str, torch.Tensor]]:
    """{name: {"model", "exp_avg", "exp_avg_sq"}} of a checkpoint, read in the TP 1 / EP 1 layout."""
    return full_state(ckpt_dir, model_dir, lambda d, r: ckpt.load_rank_payload(d, r, mmap=True))


def _adam_direction(state: dict, cfg, step: int) -> torch.Tensor:
    """AdamW's step direction m_hat / (sqrt(v_hat) + eps) after `step` steps, from a checkpoint's moments."""
    m_hat = state["exp_avg"].double() / (1 - cfg.adam_beta1 ** step)
    v_hat = state["exp_avg_sq"].double() / (1 - cfg.adam_beta2 ** step)
    return m_hat / (v_hat.sqrt() + cfg.adam_eps)


def _assert_same_state(a: dict, b: dict, n_tokens: int) -> None:
    """The state after the same step taken in two layouts, equal up to the rounding another order of sums gives.

    A resharded run sums in another order (TP's partial products, another rank's share of a batch), so it equals
    the uninterrupted run to rounding, not bit for bit (tests/tolerance.py):
      * the Adam moments: each gradient element is a sum over the batch's `n_tokens` tokens; its sum of absolute
        terms is not known after the fact, and the tensor's largest moment stands in for it;
      * the weights: Adam divides by sqrt(v_hat), which turns a gradient's last-bit difference into a step that
        can differ by a visible share of lr (1.6e-6 at lr 1e-2 on an AVX-512 host). So each run's weights are
        compared with the step its own moments give: (w_a - w_b) + lr (d_a - d_b) must be the rounding of the
        update w - lr d, 4 rounded operations on values of size |w| + lr |d|. A weight, moment or step count
        that a reshard got wrong is off by the size of the values, not by their rounding.
    """
    cfg = trainer_cfg(1)
    assert cfg.weight_decay == 0 and cfg.lr_warmup_steps == 0 and cfg.lr_schedule == "constant"
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        for key in ("model", "exp_avg", "exp_avg_sq"):
            assert a[name][key] is not None and b[name][key] is not None, (name, key)
            assert a[name][key].shape == b[name][key].shape, (name, key)
        for key in ("exp_avg", "exp_avg_sq"):
            x, y = a[name][key].float(), b[name][key].float()
            assert_within_rounding(x, y, n_tokens, y.abs().max().item(), torch.float32, f"{name} {key}")
        d_a, d_b = _adam_direction(a[name], cfg, 2), _adam_direction(b[name], cfg, 2)
        w_a, w_b = a[name]["model"].double(), b[name]["model"].double()
        assert_within_rounding(w_a + cfg.lr * d_a, w_b + cfg.lr * d_b, 4, w_b.abs() + cfg.lr * d_b.abs(),
                               torch.float32, f"{name} weights, each run's own Adam step taken back")


def _assert_same_step(resumed: dict, uninterrupted: dict) -> None:
    assert resumed["version"] == uninterrupted["version"] == 2
    for k in LOSS_KEYS:
        assert resumed["step"][k] == pytest.approx(uninterrupted["step"][k], abs=1e-6, rel=1e-6), k
    assert (resumed["logp"] - uninterrupted["logp"]).abs().max() <= 1e-6


@pytest.mark.parametrize("case, saved, resumed_dir", [
    ("dp2-ep2-to-dp1", "ep2_next", "ep2_resumed"),
    ("tp2-to-tp1", "tp2_next", "tp2_resumed"),
    ("dp1-to-dp2-ep2", "dp1_next", "dp1_resumed"),
])
def test_resume_in_another_layout_is_the_uninterrupted_step(runs, tiny_moe_dir, case, saved, resumed_dir):
    root, two, one, back = runs
    resumed, uninterrupted = {
        "dp2-ep2-to-dp1": (one["ep"], two[0]["ep"]),
        "tp2-to-tp1": (one["tp"], two[0]["tp"]),
        "dp1-to-dp2-ep2": (back[0], one["one"]),
    }[case]
    _assert_same_step(resumed, uninterrupted)
    _assert_same_state(_full_state(root / resumed_dir, tiny_moe_dir), _full_state(root / saved, tiny_moe_dir),
                       n_tokens=int(uninterrupted["logp"].numel()))  # the batch's B x T positions


def test_a_dp2_save_writes_each_byte_once(runs, tiny_moe_dir):
    root, *_ = runs
    d = root / "ep2"
    meta = json.loads((d / "meta.json").read_text())
    assert meta["distributed_optimizer"] is True and meta["world_size"] == 2 and meta["ep"] == 2
    # model + Adam moments (fp32: the main params are the model params): 3 x 4 bytes per parameter
    n_params = sum(t.numel() for t in ckpt.load_rank_payload(root / "dp1", 0)["model"].values()
                   if isinstance(t, torch.Tensor))
    tensor_bytes = 0
    for r in range(2):
        payload = ckpt.load_rank_payload(d, r)
        tensor_bytes += sum(t.numel() * t.element_size() for t in payload["model"].values()
                            if isinstance(t, torch.Tensor))
        for piece in payload["optimizer"]["params"].values():
            tensor_bytes += sum(piece[k].numel() * piece[k].element_size() for k in ("exp_avg", "exp_avg_sq"))
    assert tensor_bytes == 3 * 4 * n_params
    on_disk = sum(p.stat().st_size for p in d.iterdir())
    # the rest is per-rank RNG state, pickles and zip headers: well under one replica more (which was 2x)
    assert on_disk < 1.25 * tensor_bytes, (on_disk, tensor_bytes)
    # the dense optimizer state is split over both DP ranks: each holds half of it
    sizes = [(d / f"rank_{r}.pt").stat().st_size for r in range(2)]
    assert max(sizes) < 0.7 * sum(sizes)


def test_a_resharded_checkpoint_exports_the_same_hf_tensors(runs, tiny_moe_dir, tmp_path):
    from gspo_ray.trainer.weights.hf_export import export_checkpoint

    root, *_ = runs
    for saved, as_one in (("tp2", "tp2_as1"), ("ep2", "ep2_as1")):  # TP 2 / DP 1, and DP 2 / EP 2, vs DP 1
        # small shards: the streamed writer really splits the model (and writes the index)
        a_dir = export_checkpoint(root / saved, tiny_moe_dir, tmp_path / saved, max_shard_bytes=40_000)
        b_dir = export_checkpoint(root / as_one, tiny_moe_dir, tmp_path / as_one, max_shard_bytes=40_000)
        a, b = _read_sharded(a_dir), _read_sharded(b_dir)
        assert a.keys() == b.keys() and len(a) > 10
        for k in a:
            assert torch.equal(a[k], b[k]), (saved, k)


def _read_sharded(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2
    out = {k: v for f in sorted(set(index.values())) for k, v in load_file(str(hf_dir / f)).items()}
    assert out.keys() == index.keys()
    return out


_EXPORT_RSS = """
import json, sys
from gspo_ray.trainer.weights.hf_export import export_checkpoint
from gspo_ray.trainer.checkpoints import checkpoint


def status(key):  # kB -> bytes, from /proc/self/status
    line = next(ln for ln in open("/proc/self/status") if ln.startswith(key + ":"))
    return int(line.split()[1]) * 1024


checkpoint.read_meta(sys.argv[1])
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from the current RSS
before = status("VmRSS")
if sys.argv[4] == "export":
    export_checkpoint(sys.argv[1], sys.argv[2], sys.argv[3], max_shard_bytes=2 ** 20)
else:  # what a reader of whole rank files holds
    state = checkpoint.load_rank_payload(sys.argv[1], 0)
print(json.dumps({"before": before, "peak": status("VmHWM")}))
"""


def _export_rss(ckpt_dir, model_dir, out, how: str) -> int:
    """How far the peak RSS of a fresh process rose above its RSS while it ran `how` (export | load)."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _EXPORT_RSS, str(ckpt_dir), str(model_dir), str(out), how],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    return rss["peak"] - rss["before"]


def test_the_hf_export_reads_neither_the_optimizer_nor_the_whole_model(runs, tiny_moe_dir, tmp_path):
    """A rank file with 256 MiB of optimizer state: the export's peak RSS grows by far less than that file."""
    import shutil

    from gspo_ray.trainer.checkpoints.durable import sha256_file

    root, *_ = runs
    d = shutil.copytree(root / "tp2", tmp_path / "big")
    payload = torch.load(d / "rank_0.pt", weights_only=True)
    name = next(iter(payload["optimizer"]["params"]))
    payload["optimizer"]["params"][name]["exp_avg"] = torch.ones(2 ** 26)  # 256 MiB of (fake) optimizer state
    torch.save(payload, d / "rank_0.pt")
    meta = json.loads((d / "meta.json").read_text())
    meta["files"]["rank_0.pt"] = {"size": (d / "rank_0.pt").stat().st_size, "sha256": sha256_file(d / "rank_0.pt")}
    (d / "meta.json").write_text(json.dumps(meta))
    file_size = (d / "rank_0.pt").stat().st_size
    grown = _export_rss(d, tiny_moe_dir, tmp_path / "hf", "export")
    whole = _export_rss(d, tiny_moe_dir, tmp_path / "hf", "load")  # the measure sees a whole-file read
    print(f"export peak RSS +{grown / 2**20:.1f} MiB; torch.load of rank_0.pt +{whole / 2**20:.1f} MiB; "
          f"rank_0.pt {file_size / 2**20:.1f} MiB")
    assert whole > file_size / 2
    assert grown < file_size / 8, (grown, file_size)
    assert (tmp_path / "hf" / "config.json").exists()
