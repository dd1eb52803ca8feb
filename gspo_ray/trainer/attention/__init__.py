"""The trainer's core attention, by segment: memory and work grow with a row's segments, not its width squared.

    segment_attention.py   the Segments record (padded, group and packed rows) and torch SDPA per segment
    te_attention.py        the same segments in THD layout through Transformer Engine's fused attention (CUDA)
    gated_attention.py     Qwen3-Next's output-gated attention layout and zero-centred RMSNorm (no family yet)
"""
