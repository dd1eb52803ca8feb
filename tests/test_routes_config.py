"""Config and preflight of the engine's routes: R3 is accepted in async mode with partial rollouts (R2 still
refused there), and a dense model, or CPU engines of a vLLM the route hook was not checked on, end in one line
naming the field, exit 2, before Ray."""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gspo_ray.config import ConfigError, load_config
from gspo_ray.preflight.model import PreflightError

RECIPE = Path(__file__).resolve().parents[1] / "gspo_ray" / "recipes" / "tiny_moe.yaml"
ASYNC_PARTIAL = ["coordinator.mode=async", "rollout.partial.segment_tokens=2", "rollout.partial.stale_policy=keep"]


def test_r3_is_accepted_in_async_mode_with_partial_rollouts_and_r2_is_not():
    cfg = load_config(RECIPE, [*ASYNC_PARTIAL, "trainer.routing_replay=R3"])
    assert cfg.trainer.routing_replay == "R3"
    from gspo_ray.coordinator.pools import rollout_config

    assert rollout_config(cfg).capture_routes  # the engines return routes
    assert not rollout_config(load_config(RECIPE, ASYNC_PARTIAL)).capture_routes
    with pytest.raises(ConfigError, match="trainer.routing_replay 'R2' needs coordinator.mode 'sync'"):
        load_config(RECIPE, [*ASYNC_PARTIAL, "trainer.routing_replay=R2"])


@pytest.mark.parametrize("field", ["trainer.routing_replay=R3", "trainer.routing_agreement=true"])
def test_a_dense_tiny_model_is_refused(field):
    with pytest.raises(ConfigError, match=r"needs an MoE model: model.tiny.arch 'qwen2'"):
        load_config(RECIPE, [field, "model.tiny.arch=qwen2"])


def test_a_vllm_without_the_route_hook_is_refused(monkeypatch):
    from gspo_ray.compat import vllm_cpu_routes
    from gspo_ray.preflight import routes

    assert routes.HOOKED_MINOR_VERSIONS == vllm_cpu_routes.HOOKED_MINOR_VERSIONS  # one list, kept twice
    cfg = load_config(RECIPE, ["trainer.routing_replay=R3"])
    routes.check_routes(cfg, {"num_experts": 4}, "model.path (x)")  # the installed vLLM: fine
    monkeypatch.setattr(routes, "version", lambda name: "0.33.1")
    with pytest.raises(PreflightError, match=r"trainer.routing_replay 'R3': CPU engines of vLLM \(0, 33\)"):
        routes.check_routes(cfg, {"num_experts": 4}, "model.path (x)")


def test_r3_on_a_dense_model_directory_ends_in_one_line_and_exit_2(tmp_path):
    from gspo_ray.cli import app
    from gspo_ray.models.tiny import ensure_tiny_model

    model = ensure_tiny_model("qwen2", tmp_path / "dense", seed=0)
    job = yaml.safe_load(RECIPE.read_text())
    job.setdefault("model", {}).pop("tiny", None)
    job["model"]["path"] = str(model)
    job.setdefault("trainer", {})["routing_replay"] = "R3"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    with contextlib.chdir(tmp_path):
        result = CliRunner().invoke(app, ["config", "validate", "job.yaml"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: trainer.routing_replay 'R3' needs an MoE model"), lines


def test_routes_need_the_in_process_engine():
    """The capture hooks the in-process engine's runner: a TP 2 engine's routers run in its worker processes."""
    with pytest.raises(ConfigError, match=r"trainer.routing_replay 'R3' needs rollout.tensor_parallel_size 1 \(got 2\)"):
        load_config(RECIPE, ["trainer.routing_replay=R3", "rollout.tensor_parallel_size=2"])


def test_an_engine_trainer_mismatch_of_moe_layers_is_refused(tmp_path):
    """vLLM's Mixtral routes every layer; a config.json carrying decoder_sparse_step 2 (a Qwen3-MoE key) would give
    the trainer's converter one MoE layer of two: the engine's routes would not fit, refused before Ray."""
    from transformers import CONFIG_MAPPING

    from gspo_ray.preflight import routes

    cfg = load_config(RECIPE, ["trainer.routing_replay=R3"])
    hf = CONFIG_MAPPING["mixtral"](vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                   num_experts_per_tok=2).to_dict()
    assert routes.engine_routes_shape(hf) == routes.trainer_routes_shape(hf, "x") == (2, 2, 4)
    routes.check_routes(cfg, hf, "model.path (x)")  # agreeing readings: fine
    with pytest.raises(PreflightError, match=r"^trainer.routing_replay 'R3': the engine's routes of model.path \(x\) "
                                             r"would have 2 MoE layers x top-2 of 4 experts .* the trainer's model "
                                             r"1 x top-2 of 4$"):
        routes.check_routes(cfg, {**hf, "decoder_sparse_step": 2}, "model.path (x)")
