"""Gated DeltaNet (linear attention with a recurrent state) by segment: the linear-attention layers of the hybrid
families (Qwen3-Next), run per segment of a Segments record as attention by segment is.

    delta_rule.py   the gated delta rule, chunked, with the recurrent state passed in and out (torch on CPU;
                    flash-linear-attention's `chunk_gated_delta_rule` with `cu_seqlens` on CUDA where importable)
    by_segment.py   the causal short convolution with its state, and the segments of a row: packed units restart
                    from zero, group rows start every completion from the prefix's final states
    layer.py        GatedDeltaNet: the layer (projections, gates, gated RMSNorm) in Qwen3-Next's weight layout
"""
