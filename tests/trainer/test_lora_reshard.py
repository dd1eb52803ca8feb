"""LoRA checkpoints across TP sizes (trainer/checkpoints/shards.py with lora.adapters.adapter_tp_split): a LoRA run
saved at TP 1 resumes at TP 2, real megatron-core on gloo (two spawned ranks, the tiny qwen2 whose odd vocabulary TP 2
pads).

The TP 1 run (DP 2) takes a step, saves, and takes a second step. The TP 2 run (DP 1) loads that checkpoint, saves
it again at once, and takes the same second step. The adapters and their Adam moments saved at TP 2 must be the
TP 1 ones bit for bit (read back in the TP 1 layout, as an export reads them); the log-probs after the load and
after the second step must equal the TP 1 run's to the rounding TP's other order of sums gives.
"""
from __future__ import annotations

import torch

from _spawn import algo_cfg, make_batch, run_ranks, trainer_cfg, with_old_logp

LORA = {"rank": 4, "alpha": 8.0}


def _scenario(rank, world_size, ports, model_dir, root, batch):
    from gspo_ray.trainer.worker import TrainerWorker

    out = {}
    w = TrainerWorker(rank, world_size, "127.0.0.1", ports[0], model_dir,
                      trainer_cfg(2, lr=3e-2, micro_batch_size=2, lora=LORA), algo_cfg())
    batch = with_old_logp(batch, w.compute_logprobs(batch))
    w.train_step(batch)
    w.save(f"{root}/tp1")
    out["after1"] = w.compute_logprobs(batch, temperature=1.0)
    w.train_step(batch)
    out["straight"] = w.compute_logprobs(batch)
    w.shutdown()

    w = TrainerWorker(rank, world_size, "127.0.0.1", ports[1], model_dir,
                      trainer_cfg(2, tp=2, lr=3e-2, micro_batch_size=2, lora=LORA), algo_cfg())
    w.load(f"{root}/tp1")
    w.save(f"{root}/tp2")
    out["loaded"] = w.compute_logprobs(batch, temperature=1.0)
    w.train_step(batch)
    out["resumed"] = w.compute_logprobs(batch)
    w.shutdown()
    return out


def test_a_lora_checkpoint_of_tp1_resumes_at_tp2(tiny_qwen2_dir, tmp_path):
    from gspo_ray.trainer.checkpoints import checkpoint as ckpt
    from gspo_ray.trainer.checkpoints.shards import full_state

    ranks = run_ranks(_scenario, 2, (str(tiny_qwen2_dir), str(tmp_path), make_batch(8, seed=31)), n_ports=2)
    read = lambda d: full_state(tmp_path / d, tiny_qwen2_dir, lambda c, r: ckpt.load_rank_payload(c, r))  # noqa
    tp1, tp2 = read("tp1"), read("tp2")
    assert tp1.keys() == tp2.keys() and len(tp1) > 10 and all(".lora." in n for n in tp1)
    for name in tp1:
        for key in ("model", "exp_avg", "exp_avg_sq"):
            assert torch.equal(tp1[name][key], tp2[name][key]), (name, key)
    for r in ranks:
        torch.testing.assert_close(r["loaded"], r["after1"], rtol=0, atol=1e-5)
        torch.testing.assert_close(r["resumed"], r["straight"], rtol=0, atol=1e-4)
    assert not torch.equal(ranks[0]["straight"], ranks[0]["after1"])  # the second step moved the policy
