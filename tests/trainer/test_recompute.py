"""trainer.recompute: none, selective and full give the same train step (loss, every reduced gradient), and full
keeps fewer bytes for the backward.

One spawned process per model builds a TrainerWorker per mode on the same weights and takes one GSPO step on a
batch of prompt groups with a shared prompt (group rows: attention by segment's completion calls, which it
checkpoints itself unless Megatron recomputes the attention). What the autograd graph keeps is counted with
saved-tensor hooks: the peak of bytes packed and not yet released, over the step's forwards and backwards
(recomputed chunks included, as they are packed in the backward).
"""
from __future__ import annotations

import pytest
import torch

from _spawn import algo_cfg, run_ranks, trainer_cfg, with_old_logp

MODES = ("none", "selective", "full")


def shared_prompt_batch(vocab: int = 22, groups: int = 2, group_size: int = 4, seed: int = 0):
    """groups x group_size samples; a group's samples share its prompt (7 tokens), completions of 3-12 tokens."""
    from gspo_ray.data.records import Sample, collate

    g = torch.Generator().manual_seed(seed)
    samples, advs = [], []
    for i in range(groups):
        prompt = torch.randint(3, vocab, (7,), generator=g).tolist()
        for j in range(group_size):
            c = int(torch.randint(3, 13, (1,), generator=g))
            samples.append(Sample(prompt_uid=f"p{i}", sample_index=j, prompt_ids=prompt,
                                  completion_ids=torch.randint(3, vocab, (c,), generator=g).tolist(),
                                  logprobs=[0.0] * c, loss_mask=[1] * c, versions=[0] * c, finish_reason="stop"))
            advs.append([1.0 if j % 2 == 0 else -0.5] * c)
    return collate(samples, advs)


class SavedBytes:
    """Saved-tensor hooks counting the bytes the autograd graph holds (each saved tensor until its graph node is
    freed) and their peak."""

    def __init__(self):
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor):
        return _Held(t, self)

    @staticmethod
    def unpack(held):
        return held.tensor


class _Held:
    def __init__(self, tensor: torch.Tensor, counter: SavedBytes):
        self.tensor, self.counter, self.nbytes = tensor, counter, tensor.numel() * tensor.element_size()
        counter.live += self.nbytes
        counter.peak = max(counter.peak, counter.live)

    def __del__(self):
        self.counter.live -= self.nbytes


def _scenario(rank, world_size, ports, model_dir, batch):
    from gspo_ray.trainer.worker import TrainerWorker

    out = {}
    for mode, port in zip(MODES, ports):
        w = TrainerWorker(0, 1, "127.0.0.1", port, model_dir,
                          trainer_cfg(1, micro_batch_size=8, recompute=mode), algo_cfg())
        if mode == "none":
            batch = with_old_logp(batch, w.compute_logprobs(batch))
        counter = SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            metrics = w.train_step(batch)
        buffers = w.ddp.buffers + w.ddp.expert_parallel_buffers
        out[mode] = {"loss": metrics["train/loss"], "grads": [b.grad_data.clone() for b in buffers],
                     "saved_peak": counter.peak, "granularity": w.gpt.config.recompute_granularity,
                     "modules": list(w.gpt.config.recompute_modules or []),
                     "layers_recomputed": sum("forward" in vars(layer) for layer in w.gpt.decoder.layers),
                     "attention": {m.recompute for m in w.gpt.modules() if hasattr(m, "recompute")}}
        w.shutdown()
    return out


@pytest.fixture(scope="module", params=["llama", "moe"])
def runs(request, tiny_llama_dir, tiny_moe_dir):
    model_dir = str(tiny_llama_dir if request.param == "llama" else tiny_moe_dir)
    return run_ranks(_scenario, 1, (model_dir, shared_prompt_batch()), n_ports=len(MODES))[0]


def test_recompute_modes_give_the_same_step(runs):
    """Recomputation reruns the same kernels on the same inputs: the loss and every reduced gradient are equal
    bit for bit (torch.equal), not only to rounding."""
    layers = runs["none"]["grads"] and 2  # both tiny models have 2 layers
    assert (runs["full"]["layers_recomputed"], runs["full"]["attention"]) == (layers, {"layer"})
    assert runs["selective"]["modules"] == ["mlp"] and runs["selective"]["attention"] == {"call"}
    assert (runs["none"]["layers_recomputed"], runs["none"]["attention"]) == (0, {"none"})
    base = runs["none"]
    assert any(g.abs().sum() > 0 for g in base["grads"])  # a step with gradients to compare
    for mode in ("selective", "full"):
        assert runs[mode]["loss"] == base["loss"], mode
        for a, b in zip(runs[mode]["grads"], base["grads"], strict=True):
            assert torch.equal(a, b), mode


def test_full_recompute_keeps_fewer_bytes(runs):
    none, selective, full = (runs[m]["saved_peak"] for m in MODES)
    assert full < 0.7 * none, (full, none)
    assert selective < none, (selective, none)


def test_full_recompute_refused_beside_routing_replay():
    from pydantic import ValidationError

    from gspo_ray.config import TrainerConfig

    with pytest.raises(ValidationError, match="trainer.recompute: full cannot run beside trainer.routing_replay"):
        TrainerConfig(recompute="full", routing_replay="R2")
    with pytest.raises(ValidationError, match="recompute_modules is read with trainer.recompute: selective only"):
        TrainerConfig(recompute="full", recompute_modules=["mlp"])
    assert TrainerConfig(recompute="full", routing_replay="none").recompute == "full"


def test_optimizer_offload_is_refused_on_cpu():
    from pydantic import ValidationError

    from gspo_ray.config import TrainerConfig
    from gspo_ray.trainer.optim import build_optimizer_config

    with pytest.raises(ValidationError, match="trainer.optimizer_cpu_offload needs GPU trainer ranks"):
        TrainerConfig(optimizer_cpu_offload=True)
    gpu = TrainerConfig(optimizer_cpu_offload=True, num_gpus_per_worker=1)
    assert gpu.distributed_optimizer  # at DP 1 too: Megatron offloads the distributed optimizer's state
    assert not build_optimizer_config(TrainerConfig()).optimizer_cpu_offload
    with pytest.raises(ValueError, match="trainer.optimizer_cpu_offload needs CUDA"):  # this machine has none
        build_optimizer_config(gpu)
