"""Qwen3-MoE (`model_type: qwen3_moe`): Qwen3's attention (QK-norm) with routed experts (`num_experts`,
`moe_intermediate_size`) in the layers `decoder_sparse_step` / `mlp_only_layers` pick; softmax router, plain top-k,
renormalised when `norm_topk_prob`. HF names are the base rules' own (`mlp.gate`, `mlp.experts.{e}.gate_proj`)."""
from gspo_ray.trainer.families.base import MoEFamily


class Qwen3MoE(MoEFamily):
    model_type = "qwen3_moe"
    engine_class = "Qwen3MoeForCausalLM"
    qk_norm = True

    def engine_routes_shape(self, config) -> tuple[int, int, int]:
        """vLLM's Qwen3-MoE makes a layer MoE by `mlp_only_layers` and `decoder_sparse_step`, as the trainer does."""
        dense = set(getattr(config, "mlp_only_layers", None) or [])
        layers = sum(i not in dense and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
                     for i in range(config.num_hidden_layers))
        return layers, config.num_experts_per_tok, config.num_experts


FAMILY = Qwen3MoE()
