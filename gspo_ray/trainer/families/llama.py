"""Llama (`model_type: llama`): the base family as it is, no biases, no QK-norm (SmolLM2 is one)."""
from gspo_ray.trainer.families.base import Family


class Llama(Family):
    model_type = "llama"
    engine_class = "LlamaForCausalLM"


FAMILY = Llama()
