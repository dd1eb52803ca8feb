"""Pipeline parallelism (trainer.pp > 1): the trainer's micro-batches through Megatron's 1F1B schedule.

    records = run_pipeline(model, micro_batches, forward, loss)                  # a training pass (backward too)
    records = run_pipeline(model, micro_batches, forward, keep, forward_only=True)
    obj = from_last_stage(obj)                       # a picklable object of the last stage on every stage
    t = tensor_from_last_stage(t)                    # likewise a tensor (same shape and dtype on every stage)

Every stage holds the whole mini-batch and plans the same micro-batches (a deterministic function of the batch
and the DP rank), so each stage rebuilds a micro-batch's layout (segments, positions, score mask) itself: only the
hidden states [S, B, H] travel between stages, each send preceded by its shape (`variable_seq_lengths`: the
micro-batches are token budgets, of any width and row count). `forward(mb)` runs this stage's part of the model
(trainer/logprobs.py: hidden states before the last stage, log-probs on it); on the last stage `loss(mb, output)`
-> (loss tensor, record) gives what the backward starts from and a record kept in micro-batch order.

Schedule: `get_forward_backward_func()`, which for PP > 1 without virtual stages is 1F1B
(`forward_backward_pipelining_without_interleaving`: PP - 1 - stage warm-up forwards, then one forward one
backward, then the cool-down backwards); stage outputs are exchanged by `batch_isend_irecv` (works on gloo: checked
by tests/trainer/test_pipeline.py), the model config's `batch_p2p_comm` default. Loss scaling: Megatron divides a
2-tuple loss by the number of micro-batches (its losses are means); ours already carries each micro-batch's weight
(worker.py, "Loss scaling"), so the loss function returns Megatron's 3-tuple (loss, 1 token, record) under
`calculate_per_token_loss`, which neither divides nor scales (no finalize function is set: the step's
`finalize_model_grads` runs in optim.optimizer_step, as at PP 1). The backward of the last stage is
`loss.backward()`, of the others `output.backward(grad from the next stage)`: the same gradients as PP 1, bit for
bit (tests/trainer/test_pipeline.py). Interleaved (virtual) stages are not built.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist

from gspo_ray.compat.megatron_cpu import cpu_device_mode


def pipeline_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size()


def is_last_stage() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage()


def _last_stage_rank() -> tuple[object, int]:
    """(pipeline group, the global rank of its last stage)."""
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    return group, dist.get_process_group_ranks(group)[-1]


def from_last_stage(obj):
    """The last stage's `obj` on every stage of this rank's pipeline group (collective over it)."""
    group, src = _last_stage_rank()
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def tensor_from_last_stage(t: torch.Tensor) -> torch.Tensor:
    """The last stage's values of `t` (same shape and dtype everywhere), in place, on every stage."""
    group, src = _last_stage_rank()
    dist.broadcast(t, src=src, group=group)
    return t


@contextlib.contextmanager
def _unscaled_losses(config):
    """Megatron's schedule leaves the 3-tuple losses as given (module doc); the flag is restored after."""
    saved = config.calculate_per_token_loss
    config.calculate_per_token_loss = True
    try:
        yield
    finally:
        config.calculate_per_token_loss = saved


def run_pipeline(model, micro_batches: list, forward: Callable, loss: Callable, *,
                 forward_only: bool = False) -> list:
    """One pass of `micro_batches` through the pipeline (collective over the pipeline group; every stage passes
    the same micro-batches). Returns the last stage's records in micro-batch order ([] on other stages).
    forward_only: no backward (log-probs for anchors, references and the push probe)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        return []
    one = torch.ones((), dtype=torch.int)  # Megatron's token count of a loss (unused: see _unscaled_losses)

    def forward_step(data_iterator, stage_model):
        mb = next(data_iterator)
        output = forward(mb)

        def loss_func(out):
            value, record = loss(mb, out)
            return value, one, record

        return output, loss_func

    config = model.config
    width = max(int(mb.num_tokens) for mb in micro_batches)  # ignored with variable_seq_lengths (module doc)
    with cpu_device_mode(), _unscaled_losses(config):
        return list(get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
            num_microbatches=len(micro_batches), seq_length=width, micro_batch_size=1, forward_only=forward_only))
