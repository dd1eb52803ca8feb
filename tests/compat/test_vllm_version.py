"""The one vLLM version parser every guard of gspo_ray/compat/ and the adapter swap use (`vllm_minor` itself runs
in each guard's own test)."""
from gspo_ray.compat.vllm_version import parse_minor


def test_versions_parse_to_major_minor():
    assert parse_minor("0.32.0+cpu") == (0, 32) and parse_minor("1.10") == (1, 10)
    assert parse_minor("0.32.1rc2.dev5") == (0, 32)
