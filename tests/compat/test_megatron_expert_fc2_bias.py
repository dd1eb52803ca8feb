"""compat/megatron_expert_fc2_bias.py: still needed while Megatron's MLP adds an expert's weighted fc2 bias in place
(the 1-process backward and the TP 2 + SP steps of tests/trainer/test_family_gpt_oss.py fail without the hook)."""
import inspect


def test_megatron_still_adds_the_expert_bias_in_place():
    from gspo_ray.compat.megatron_expert_fc2_bias import INPLACE_LINE
    from gspo_ray.compat.megatron_import import megatron_core  # noqa: F401
    from megatron.core.transformer.mlp import MLP

    assert INPLACE_LINE in inspect.getsource(MLP.forward)
