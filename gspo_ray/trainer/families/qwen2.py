"""Qwen2 (`model_type: qwen2`): Llama with biases on the q / k / v projections, which config.json does not announce
(`attention_bias` is absent; the tensors are in every checkpoint)."""
from gspo_ray.trainer.families.base import Family


class Qwen2(Family):
    model_type = "qwen2"
    engine_class = "Qwen2ForCausalLM"
    qkv_bias = True


FAMILY = Qwen2()
