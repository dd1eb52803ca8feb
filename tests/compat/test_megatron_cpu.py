"""Each megatron-core CPU workaround is still needed (the original call fails as recorded) and still correct.

One pair of spawned ranks (gloo, EP=2, tiny Qwen3-MoE with the alltoall dispatcher, tiny Qwen2 for the optimizer)
first checks what each patch does, then lifts the patches one at a time (`megatron_cpu.unapplied`) and
records the failure. When a megatron-core upgrade fixes one of them, its `needed` case fails here: drop the patch.
The exact match of whole-model log-probs with transformers (test_bridge_logprobs.py) is the end-to-end proof of
patches 1-6 under DP, TP+SP and EP.
"""
from __future__ import annotations

import traceback

import pytest
import torch

from _spawn import run_ranks

# workaround -> (exception type, message fragment, megatron file(s) the failure surfaces in)
NEEDED = {
    # rotary embedding on a sequence length it has not cached yet, else the MoE router
    "current_device": ("AssertionError", "Torch not compiled with CUDA enabled",
                       ("rotary_pos_embedding.py", "moe/router.py")),
    "rng_tracker": ("AssertionError", "Torch not compiled with CUDA enabled", "tensor_parallel/random.py"),
    "te_general_gemm": ("NameError", "te_general_gemm", "moe/moe_utils.py"),
    "cuda_streams": ("RuntimeError", "torch.cuda.Stream requires CUDA support", "moe/token_dispatcher.py"),
    "alltoall_split_sizes": ("TypeError", "all_to_all_single(): incompatible function arguments",
                             "tensor_parallel/mappings.py"),
    "torch_norm_sequence_parallel": ("AssertionError", "sequence parallel not supported by torch LayerNorm",
                                     "transformer/torch_norm.py"),
    "cpu_device_mode": ("AssertionError", "Torch not compiled with CUDA enabled", "optimizer/optimizer.py"),
    "cuda_synchronize": ("AssertionError", "Torch not compiled with CUDA enabled",
                         "pipeline_parallel/p2p_communication.py"),
}


def _failure(fn) -> tuple[str, str, str] | None:
    """(exception type, message, last megatron file in the traceback) of fn(), or None if it succeeded."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recording the failure is the point
        files = [f.filename.split("megatron/core/")[-1] for f in traceback.extract_tb(e.__traceback__)
                 if "megatron/core/" in f.filename]
        return type(e).__name__, str(e)[:300], files[-1] if files else ""
    return None


def _sp_config():
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                             tensor_model_parallel_size=2, sequence_parallel=True, use_cpu_initialization=True)


def _check_rng(rank: int) -> dict:
    """The trackers hold CPU generator states seeded as Megatron documents; fork() restores the global state."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(123)
    before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():  # model-parallel state: seed + 2718 + tp_rank (tp_rank 0 here)
        tp_draw = torch.rand(4)
    with get_cuda_rng_tracker().fork("expert-parallel-rng"):  # seed + 1024 + 100 * ep_rank
        ep_draw = torch.rand(4)
    return {"tp_draw_ok": torch.equal(tp_draw, torch.rand(4, generator=torch.Generator().manual_seed(123 + 2718))),
            "ep_draw_ok": torch.equal(ep_draw, torch.rand(4, generator=torch.Generator().manual_seed(
                123 + 1024 + 100 * rank))),
            "global_state_kept": torch.equal(before, torch.get_rng_state())}


def _check_alltoall(rank: int) -> dict:
    """Unequal splits given as tensors: rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 3 and 1."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import all_to_all

    send = {0: [1, 2], 1: [3, 1]}
    recv = [send[0][rank], send[1][rank]]
    x = (torch.arange(sum(send[rank]), dtype=torch.float32) + 100 * rank).requires_grad_()
    y = all_to_all(parallel_state.get_expert_model_parallel_group(), x[:, None], torch.tensor(recv),
                   torch.tensor(send[rank]))
    (y[:, 0] * torch.arange(1, len(y) + 1)).sum().backward()  # grad of each received row = its 1-based index
    expected = {0: [0.0, 100.0, 101.0, 102.0], 1: [1.0, 2.0, 103.0]}[rank]
    expected_grad = {0: [1.0, 1.0, 2.0], 1: [2.0, 3.0, 4.0, 3.0]}[rank]
    return {"rows_ok": y[:, 0].tolist() == expected, "grad_ok": x.grad.tolist() == expected_grad}


def _check_norm() -> dict:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    norm = WrappedTorchNorm(_sp_config(), 8, eps=1e-6)
    x = torch.randn(3, 8)
    ref = torch.nn.functional.rms_norm(x, (8,), norm.weight, 1e-6)
    plain = _sp_config()
    plain.sequence_parallel = False
    return {"is_rmsnorm": isinstance(norm, torch.nn.RMSNorm), "marked": getattr(norm.weight, "sequence_parallel", 0),
            "values_ok": torch.allclose(norm(x), ref, atol=0, rtol=0),
            "plain_unmarked": not hasattr(WrappedTorchNorm(plain, 8).weight, "sequence_parallel")}


def _check_router_gemm() -> dict:
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    x, w = torch.randn(5, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    out = router_gating_linear(x, w, None, torch.float32)
    out.square().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (x @ w.t()).square().sum().backward()
    return {"values_ok": torch.allclose(out, x @ w.t()), "grads_ok": torch.allclose(gx, x.grad)
            and torch.allclose(gw, w.grad)}


def _check_streams() -> dict:
    stream = torch.cuda.Stream()
    return {"current_is_stream": torch.cuda.current_stream() == stream, "union_ok": (torch.cuda.Stream | None)
            is not None, "event_done": stream.record_event().query()}


def _optimizer(model, distributed: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=distributed, overlap_grad_reduce=False))
    cfg = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, adam_eps=1e-8, clip_grad=0.0,
                          use_distributed_optimizer=distributed)
    return ddp, get_megatron_optimizer(cfg, [ddp])


def _check_optimizer_step(qwen2_dir: str, rank: int) -> dict:
    """Distributed Adam (DP=2, optimizer state sharded) inside cpu_device_mode: the first step must move every
    parameter by exactly -lr * g / (|g| + eps), g = the DP-mean gradient (Adam's first step, no weight decay)."""
    from megatron.core.distributed import finalize_model_grads

    from gspo_ray.trainer.logprobs import forward_logprobs
    from gspo_ray.compat.megatron_cpu import cpu_device_mode
    from gspo_ray.trainer.model import build_model

    model, _ = build_model(qwen2_dir)
    with cpu_device_mode():
        ddp, opt = _optimizer(model, distributed=True)
    tokens = torch.randint(3, 23, (2, 9), generator=torch.Generator().manual_seed(rank))  # per-rank data
    forward_logprobs(ddp, tokens).sum().backward()
    # reference gradient: the DP mean of the local gradients, reduced here, independently of Megatron
    before = {n: (p.detach().clone(), p.main_grad.clone()) for n, p in model.named_parameters()}
    for _, g in before.values():
        torch.distributed.all_reduce(g)
        g /= torch.distributed.get_world_size()
    with cpu_device_mode():
        finalize_model_grads([ddp])
        ok, grad_norm, _ = opt.step()
    worst = max((p.detach() - (p0 - 1e-2 * g / (g.abs() + 1e-8))).abs().max().item()
                for (n, p), (p0, g) in zip(model.named_parameters(), before.values()))
    return {"step_ok": bool(ok), "worst": worst, "grad_norm": float(grad_norm),
            "moved": max((p.detach() - before[n][0]).abs().max().item() for n, p in model.named_parameters())}


def _exchange_shapes(config):
    """The pipeline's shape exchange of variable_seq_lengths (here with no neighbour to exchange with)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    communicator = P2PCommunicator(pp_group=parallel_state.get_pipeline_model_parallel_group(), config=config)
    return communicator._communicate_shapes(None, None, False, False)


def _scenario(rank, world_size, ports, moe_dir, qwen2_dir, rdzv):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from gspo_ray.compat import megatron_cpu as compat
    from gspo_ray.trainer.logprobs import forward_logprobs
    from gspo_ray.trainer.model import build_model
    from gspo_ray.trainer.parallel import destroy_distributed, init_distributed

    init_distributed(rank, world_size, "", 0, ep=2, init_method=f"file://{rdzv}/compat")  # no port to race for
    out = {"applied": sorted(compat.applied()), "current_device": torch.cuda.current_device(),
           "rng": _check_rng(rank), "alltoall": _check_alltoall(rank), "norm": _check_norm(),
           "router_gemm": _check_router_gemm(), "streams": _check_streams(),
           "optimizer": _check_optimizer_step(qwen2_dir, rank), "needed": {}}
    model, _ = build_model(moe_dir, moe_dispatcher="alltoall")
    tokens = torch.randint(3, 22, (2, 9), generator=torch.Generator().manual_seed(rank))
    forward = lambda: forward_logprobs(model, tokens)  # noqa: E731
    out["forward_with_all"] = _failure(forward)
    for name in ("current_device", "te_general_gemm", "alltoall_split_sizes"):
        with compat.unapplied(name):
            out["needed"][name] = _failure(forward)
    # the forward no longer forks the tracker (attention by segment has no dropout of its own); seeding and every
    # fork of it (weight init, sequence-parallel dropout regions) still go through it
    with compat.unapplied("rng_tracker"):
        out["needed"]["rng_tracker"] = _failure(lambda: _check_rng(rank))
    shared_stream = MoEAlltoAllTokenDispatcher.cuda_dtoh_stream  # created once per process, by the first dispatcher
    with compat.unapplied("cuda_streams"):
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None
        out["needed"]["cuda_streams"] = _failure(lambda: build_model(moe_dir, moe_dispatcher="alltoall"))
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = shared_stream
    with compat.unapplied("torch_norm_sequence_parallel"):
        out["needed"]["torch_norm_sequence_parallel"] = _failure(lambda: WrappedTorchNorm(_sp_config(), 8))
    with compat.unapplied("cuda_synchronize"):  # the pipeline's shape exchange (nothing to send at PP 1)
        out["needed"]["cuda_synchronize"] = _failure(lambda: _exchange_shapes(model.config))
    out["shapes_exchanged"] = _failure(lambda: _exchange_shapes(model.config))
    qwen2, _ = build_model(qwen2_dir)
    out["needed"]["cpu_device_mode"] = _failure(lambda: _optimizer(qwen2, distributed=False))
    out["forward_after"] = _failure(forward)  # every patch is back in place
    destroy_distributed()
    return out


@pytest.fixture(scope="module")
def ranks(tiny_moe_dir, tiny_qwen2_dir, tmp_path_factory):
    args = (str(tiny_moe_dir), str(tiny_qwen2_dir), str(tmp_path_factory.mktemp("rdzv")))
    return run_ranks(_scenario, 2, args, n_ports=0)


def test_all_patches_applied_and_model_runs(ranks):
    from gspo_ray.compat.megatron_cpu import WORKAROUNDS

    for r in ranks:
        assert r["applied"] == sorted(WORKAROUNDS)
        assert r["forward_with_all"] is None and r["forward_after"] is None and r["shapes_exchanged"] is None


@pytest.mark.parametrize("name", sorted(NEEDED))
def test_workaround_still_needed(ranks, name):
    kind, message, where = NEEDED[name]
    for rank, r in enumerate(ranks):
        failure = r["needed"][name]
        assert failure is not None, f"rank {rank}: megatron-core no longer fails without {name!r}: drop it"
        assert failure[0] == kind and message in failure[1] and failure[2].endswith(where), failure


def test_current_device_is_cpu(ranks):
    assert all(r["current_device"] == torch.device("cpu") for r in ranks)


def test_rng_tracker_on_cpu_generator(ranks):
    for r in ranks:
        assert r["rng"] == {"tp_draw_ok": True, "ep_draw_ok": True, "global_state_kept": True}


def test_router_gemm_fallback(ranks):
    assert ranks[0]["router_gemm"] == {"values_ok": True, "grads_ok": True}


def test_stream_stand_ins(ranks):
    assert ranks[0]["streams"] == {"current_is_stream": True, "union_ok": True, "event_done": True}


def test_alltoall_with_tensor_split_sizes(ranks):
    for r in ranks:
        assert r["alltoall"] == {"rows_ok": True, "grad_ok": True}


def test_norm_under_sequence_parallel(ranks):
    assert ranks[0]["norm"] == {"is_rmsnorm": True, "marked": True, "values_ok": True, "plain_unmarked": True}


def test_optimizer_step_in_cpu_device_mode(ranks):
    for r in ranks:
        opt = r["optimizer"]
        assert opt["step_ok"] and opt["grad_norm"] > 0 and opt["moved"] > 1e-3
        assert opt["worst"] < 1e-6, opt
    assert ranks[0]["optimizer"]["grad_norm"] == ranks[1]["optimizer"]["grad_norm"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU rewriting")
def test_cpu_device_mode_rewrites_only_inside():
    from gspo_ray.compat.megatron_cpu import CpuDeviceMode

    t = torch.zeros(2)
    with CpuDeviceMode():
        assert torch.empty(3, device="cuda").device.type == "cpu"
        assert t.cuda() is t and t.type() == "torch.cuda.FloatTensor" and t.to("cuda").device.type == "cpu"
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert t.type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.empty(3, device="cuda")


def test_unapplied_rejects_unknown_names():
    from gspo_ray.compat.megatron_cpu import unapplied

    with pytest.raises(ValueError, match="valid: current_device"):
        with unapplied("no_such_patch"):
            pass
