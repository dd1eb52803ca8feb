"""Qwen3 (`model_type: qwen3`): Llama with RMSNorm on each head's queries and keys (QK-norm), no biases."""
from gspo_ray.trainer.families.base import Family


class Qwen3(Family):
    model_type = "qwen3"
    engine_class = "Qwen3ForCausalLM"
    qk_norm = True


FAMILY = Qwen3()
