"""Mixtral (`model_type: mixtral`): Llama's attention with routed experts in every layer (`num_local_experts`, each
of the dense width `intermediate_size`); softmax router, top-k always renormalised (Mixtral has no `norm_topk_prob`
key). Its checkpoints name the MoE block `block_sparse_moe` and the experts' projections w1 (gate), w3 (up),
w2 (down). Its config's `sliding_window` turns sliding-window attention on by itself (no `use_sliding_window`)."""
from gspo_ray.trainer.families.base import MoEFamily, every_layer_routes_shape


class Mixtral(MoEFamily):
    model_type = "mixtral"
    engine_class = "MixtralForCausalLM"
    hf_renames = ((".mlp.gate.weight", ".block_sparse_moe.gate.weight"),
                  (".mlp.experts.", ".block_sparse_moe.experts."), (".gate_proj.weight", ".w1.weight"),
                  (".up_proj.weight", ".w3.weight"), (".down_proj.weight", ".w2.weight"))

    def norm_topk_prob(self, cfg: dict) -> bool:
        return True

    def sliding_window(self, cfg: dict) -> bool:
        return bool(cfg.get("use_sliding_window") or cfg.get("sliding_window"))

    def engine_routes_shape(self, config) -> tuple[int, int, int]:
        return every_layer_routes_shape(config)  # vLLM's Mixtral routes in every layer


FAMILY = Mixtral()
