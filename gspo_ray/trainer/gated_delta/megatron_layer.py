"""GatedDeltaNet as the `self_attention` submodule of a Megatron TransformerLayer (the linear-attention layers of a
hybrid model's layer spec; the softmax layers keep SelfAttention with SegmentAttention).

    ModuleSpec(module=GatedDeltaAttention, params={"heads": DeltaHeads(...), "conv_kernel": 4})

Megatron's TransformerLayer hands its self_attention the input-normed hidden states [S, B, H] and the forward's
`attention_mask`, which here is the micro-batch's Segments record (as for SegmentAttention): the layer runs by
segment (by_segment.py) and returns (output, None) (no separate bias: bias-dropout-add adds nothing). Rotary
embeddings and the rest of the attention keywords are not used (linear attention has no positions). Megatron's own
GatedDeltaNet (ssm/gated_delta_net.py) is not used: its constructor needs flash-linear-attention, its forward starts
from a zero state and refuses packed sequences (docs/real-models.md).

Refused at construction, by the trainer field: trainer.tp > 1 (the heads and convolution channels would shard by
key-head group, not built), trainer.cp > 1 (a rank's columns would need the states of the columns before it). The
family refuses both in the preflight before a model is built.
"""
from __future__ import annotations

from torch import Tensor

from gspo_ray.compat.megatron_import import megatron_core  # noqa: F401  (first: megatron without torch.compile)
from megatron.core.transformer.module import MegatronModule  # noqa: E402  (after the guarded import)

from gspo_ray.trainer.attention.segment_attention import Segments
from gspo_ray.trainer.context_parallel import layer_cp_size
from gspo_ray.trainer.gated_delta.by_segment import DeltaHeads
from gspo_ray.trainer.gated_delta.layer import GatedDeltaNet


def refusal(tp: int, cp: int) -> str | None:
    """Why a Gated DeltaNet layer cannot run in this layout (None: it can), naming the trainer fields."""
    if tp > 1:
        return (f"trainer.tp {tp} with Gated DeltaNet layers (config.json layer_types 'linear_attention') is not "
                "built (their heads and convolution channels would shard by key-head group); use trainer.tp 1")
    if cp > 1:
        return (f"trainer.cp {cp} with Gated DeltaNet layers (config.json layer_types 'linear_attention') is not "
                "supported (a rank's columns need the recurrent and convolution states of the columns before "
                "them); use trainer.cp 1")
    return None


class GatedDeltaAttention(MegatronModule):
    """Megatron self-attention submodule holding a GatedDeltaNet (`.layer`, HF tensor names below it)."""

    def __init__(self, config, layer_number: int, heads: DeltaHeads, conv_kernel: int = 4, **unused):
        super().__init__(config=config)
        why = refusal(config.tensor_model_parallel_size, layer_cp_size(config))  # CP: the process groups'
        if why is not None:
            raise NotImplementedError(why)
        self.layer_number = layer_number
        self.layer = GatedDeltaNet(config.hidden_size, heads, conv_kernel, eps=config.layernorm_epsilon,
                                   dtype=config.params_dtype)

    def forward(self, hidden_states: Tensor, attention_mask=None, inference_context=None, attention_bias=None,
                packed_seq_params=None, **unused) -> tuple[Tensor, None]:
        """[S, B, H] -> ([S, B, H], None) for the segments of `attention_mask` (None: each row one sequence)."""
        if inference_context is not None or attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("GatedDeltaAttention takes its layout from a Segments record only")
        segs = attention_mask
        if segs is None:
            segs = Segments.plain([hidden_states.shape[0]] * hidden_states.shape[1])
        if not isinstance(segs, Segments):
            raise TypeError(f"GatedDeltaAttention needs a Segments record as attention_mask, not "
                            f"{type(segs).__name__}")
        return self.layer(hidden_states, segs), None
