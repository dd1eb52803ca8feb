"""The model's weights between Megatron and HF: names, conversion, export and the pushes to the engines.

    bridge.py           HF <-> Megatron conversion rules (param_map), TP / EP sharding, HF safetensors in and out
    param_names.py      the base parameter names of each layer spec (local, Transformer Engine, grouped GEMM)
    hf_export.py        a trainer checkpoint -> HF model directory, offline (no process group)
    weight_buckets.py   the bucket plan of a push read from Megatron's shards, and the gathers it costs
    weight_send.py      pushes through vLLM's own CUDA backends (nccl, ipc): Megatron's shards as a WeightSource
    weight_export.py    a rank's export for the in-process, object-store and shared-memory pushes
"""
