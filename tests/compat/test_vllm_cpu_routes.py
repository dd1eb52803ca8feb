"""The route hook (compat/vllm_cpu_routes.py) is needed and checked for the installed vLLM. This fails when the
platform gains Triton (vLLM's own `enable_return_routed_experts` through Model Runner V2 may then work: try it and
drop the hook) or when vLLM moves past the versions the hook was checked on. Its correctness against a
transformers forward is tests/rollout/test_engine_routes.py (one engine start)."""
from __future__ import annotations

from gspo_ray.compat.vllm_cpu_routes import needs_route_hook, route_hook_available


def test_the_hook_is_still_needed_and_checked_for_this_vllm():
    assert needs_route_hook(), "Triton is available: try LLM(enable_return_routed_experts=True) before the hook"
    assert route_hook_available()
