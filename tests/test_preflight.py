"""Preflight: `config validate` and `train` stop a bad input in one line and exit 2, before Ray or an engine starts.

The table of broken inputs is re-run here through the `train` command (in-process, and once as a real subprocess that
also proves the preflight imports no Ray, vLLM or Megatron). The generated catalogue is in test_bad_inputs.py.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gspo_ray.cli import app
from gspo_ray.cli.errors import user_errors
from gspo_ray.config import load_config
from gspo_ray.models.tiny import ensure_tiny_model
from gspo_ray.preflight import PreflightError, run_preflight
from gspo_ray.preflight.model import CPU_HEAD_SIZES, CPU_MLA_LATENT, ENGINE_ARCHITECTURES

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "gspo_ray" / "recipes").glob("*.yaml"))
ROWS = [{"prompt": f"copy:{n}=", "reference": str(n)} for n in (12, 345, 6789)]


def write_job(tmp: Path, overrides: dict | None = None, rows=ROWS) -> Path:
    """A small JSONL job on the tiny model; `overrides` are merged into its sections."""
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = {"name": "pf", "logging": {"out_dir": str(tmp / "runs")}, "data": {"source": "jsonl", "path": str(data)},
           "rollout": {"max_new_tokens": 6, "max_model_len": 64}}
    for section, values in (overrides or {}).items():
        job.setdefault(section, {}).update(values) if isinstance(values, dict) else job.update({section: values})
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def invoke(*args: str):
    start = time.perf_counter()
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result, time.perf_counter() - start


def assert_clean_user_error(result, *expected: str) -> str:
    """Exit 2, no traceback, every stderr line an `error:` line; returns stderr."""
    err = result.stderr
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output and err.strip(), result.output
    assert all(line.startswith("error: ") for line in err.strip().splitlines()), err
    for text in expected:
        assert text in err, (text, err)
    return err


@pytest.fixture(scope="module")
def plugins(tmp_path_factory, monkeypatch_module):
    """A module of deliberately bad reward functions and environments, importable as `pf_plugins`."""
    root = tmp_path_factory.mktemp("plugins")
    (root / "pf_plugins.py").write_text(
        "import time\n"
        "def returns_str(completion, reference, **kw):\n    return 'good'\n"
        "def exact(completion, reference, **kw):\n    return float(completion == reference)\n"
        "def letter(completion, reference):\n    return float(ord(completion.strip()) == ord(reference))\n"
        "class ListEnv:\n"
        "    def __init__(self, tokenizer, **kw):\n        self.tokenizer = tokenizer\n"
        "    def reset(self, prompt, seed):\n        return {'obs': 1}\n"
        "    def step(self, action_ids, action_text):\n        raise NotImplementedError\n")
    (root / "pf_hang_import.py").write_text("import time\ntime.sleep(5)\ndef fn(c, r):\n    return 0.0\n")
    monkeypatch_module.syspath_prepend(str(root))
    return root


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return ensure_tiny_model("qwen2", tmp_path_factory.mktemp("model") / "qwen2", seed=0)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, qwen2_dir):
    """An architecture the converter does not know, built locally with transformers."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    out = tmp_path_factory.mktemp("model") / "gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=22, n_positions=64, n_embd=64, n_layer=1, n_head=2)).save_pretrained(out)
    AutoTokenizer.from_pretrained(qwen2_dir).save_pretrained(out)
    return out


MADE_DATA = {"smollm2_wordproblems": "wordproblems"}  # recipes that read what `gspo-ray data make TASK` writes
# recipes that read a model `gspo-ray models make-tiny ARGS` builds
MADE_MODEL = {"tiny_deepseek": ("--arch", "deepseek_v3", "--init-std", "0.02")}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipes_pass_preflight(recipe, tmp_path):
    overrides = []
    if recipe.stem in MADE_DATA:  # made here as a user makes it first (the recipe's header says how)
        made, _ = invoke("data", "make", MADE_DATA[recipe.stem], "--out", tmp_path / "data", "--num-train", 200)
        assert made.exit_code == 0, made.output
        overrides = [f"data.path={tmp_path}/data/train.parquet", f"data.eval_path={tmp_path}/data/test.parquet"]
    if recipe.stem in MADE_MODEL:  # likewise a model the recipe's header says to build first
        made, _ = invoke("models", "make-tiny", *MADE_MODEL[recipe.stem], "--out", tmp_path / "model")
        assert made.exit_code == 0, made.output
        overrides.append(f"model.path={tmp_path}/model")
    result, _ = invoke("config", "validate", recipe, *overrides)
    assert result.exit_code == 0, result.output
    assert "preflight ok" in result.stdout and "reward     " in result.stdout
    if "tiny:" in recipe.read_text():  # built when training starts: nothing to check on disk yet
        assert "model      skipped  model.tiny" in result.stdout
    assert ("env        ok" in result.stdout) == ("multi_turn" in recipe.read_text())


def test_model_dir_passes_and_its_checks_are_listed(tmp_path, qwen2_dir):
    job = write_job(tmp_path, {"model": {"path": str(qwen2_dir)}})
    result, _ = invoke("config", "validate", job)
    assert result.exit_code == 0, result.output
    for line in ("model      ok", "tokenizer  ok", "data/train ok", "3 prompts", "reward     ok"):
        assert line in result.stdout, result.stdout
    assert not (tmp_path / "runs").exists()  # validating writes nothing, not even the run directory


TABLE = {  # the table of broken inputs: (how to break the job, what the one line must name)
    "empty JSONL": (lambda tmp, dirs: write_job(tmp, rows=[]), ["data.path:", "has no rows"]),
    "row without the reference field": (
        lambda tmp, dirs: write_job(tmp, rows=[{"prompt": "copy:12=", "answer": "12"}]),
        ["data.path:", "train.jsonl:1:", "'reference'", "data.reference_field"]),
    "gpt2 model dir": (lambda tmp, dirs: write_job(tmp, {"model": {"path": str(dirs["gpt2"])}}),
                       ["model.path:", "'gpt2'", "valid: qwen2, qwen3, qwen3_moe, llama"]),
    "reward module missing": (lambda tmp, dirs: write_job(tmp, {"rollout": {"reward": {"fn": "nope.rewards:fn"}}}),
                              ["rollout.reward.fn:", "no module named 'nope'"]),
    "reward returning a string": (
        lambda tmp, dirs: write_job(tmp, {"rollout": {"reward": {"fn": "pf_plugins:returns_str"}}}),
        ["rollout.reward.fn:", "dry call", "returned str", "finite float"]),
}


@pytest.mark.parametrize("case", list(TABLE))
def test_issue_table_train_stops_in_one_line(case, tmp_path, plugins, gpt2_dir):
    make, expected = TABLE[case]
    job = make(tmp_path, {"gpt2": gpt2_dir})
    result, seconds = invoke("train", job)
    err = assert_clean_user_error(result, *expected)
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists(), "train got past the preflight"
    assert seconds < 5, seconds  # imports are warm in-process: these are the checks themselves


def test_train_subprocess_stops_before_any_engine_import(tmp_path, plugins):
    """The real command, in a fresh interpreter: exit 2 in one line, and not one of Ray, vLLM, Megatron imported."""
    job = write_job(tmp_path, {"rollout": {"reward": {"fn": "pf_plugins:returns_str"}}})
    code = ("import sys\nfrom gspo_ray.cli import main\nsys.argv = ['gspo-ray', 'train', sys.argv[1]]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    rc = e.code\n"
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'vllm', 'megatron'})\n"
            "print('HEAVY', heavy, 'RC', rc)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugins), str(ROOT)])}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, str(job)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    seconds = time.perf_counter() - start
    print(f"gspo-ray train (reward returning a string) -> exit 2 in {seconds:.1f} s")
    assert "HEAVY [] RC 2" in proc.stdout, (proc.stdout, proc.stderr)
    assert proc.stderr.strip().startswith("error: rollout.reward.fn:") and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml", "train.jsonl"]  # nothing else written


@pytest.mark.parametrize("override,expected", [
    ({"model": {"tiny": {"hidden": 48}}}, "model.tiny (qwen3_moe): head_dim = hidden / heads = 24 < 32"),
    ({"rollout": {"max_model_len": 512}}, "max_position_embeddings (256) of model.tiny (qwen3_moe)"),
    ({"trainer": {"num_workers": 4, "tp": 4}}, "tp=4 must divide num_attention_heads=2"),
])
def test_tiny_model_config_is_checked_before_it_is_built(tmp_path, override, expected):
    result, _ = invoke("config", "validate", write_job(tmp_path, override))
    assert_clean_user_error(result, expected)


def test_debug_shows_the_traceback(tmp_path):
    job = write_job(tmp_path, rows=[])
    result, _ = invoke("--debug", "config", "validate", job)
    assert result.exit_code == 2 and "Traceback" in result.stderr and "PreflightError" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: data.path:")


def test_internal_errors_keep_their_traceback():
    with pytest.raises(RuntimeError, match="a bug"):
        with user_errors():
            raise RuntimeError("a bug")


def test_hanging_plugin_import_times_out(tmp_path, plugins):
    cfg = load_config(write_job(tmp_path, {"rollout": {"reward": {"fn": "pf_hang_import:fn"}}}))
    start = time.perf_counter()
    with pytest.raises(PreflightError, match=r"rollout\.reward\.fn: importing 'pf_hang_import:fn' did not return"):
        run_preflight(cfg, import_timeout_s=0.5)
    assert time.perf_counter() - start < 3


def test_partial_rollouts_refuse_an_env_that_is_not_declared_replayable(tmp_path, plugins):
    job = write_job(tmp_path, {"rollout": {"multi_turn": {"env": "pf_plugins:ListEnv"},
                                           "partial": {"segment_tokens": 2}}})
    result, _ = invoke("config", "validate", job)
    assert_clean_user_error(result, "rollout.multi_turn.env:", "'pf_plugins:ListEnv' does not declare "
                            "`replayable = True`, which rollout.partial needs")
    (tmp_path / "ok").mkdir()  # an env that declares it passes (the rows' references are its secrets)
    job = write_job(tmp_path / "ok", {"rollout": {"multi_turn": {"env": "gspo_ray.envs.guess:GuessNumberEnv",
                                                                 "kwargs": {"high": 9999}},
                                                  "partial": {"segment_tokens": 2}}})
    result, _ = invoke("config", "validate", job)
    assert result.exit_code == 0, (result.output, result.exception)


def test_env_reset_return_type_is_checked(tmp_path, plugins):
    job = write_job(tmp_path, {"rollout": {"multi_turn": {"env": "pf_plugins:ListEnv"}}})
    result, _ = invoke("config", "validate", job)
    assert_clean_user_error(result, "rollout.multi_turn.env:", "ListEnv.reset on a dry call: reset returned a dict",
                            "valid: token ids")


def test_multi_line_config_errors_are_one_line_each(tmp_path):
    job = write_job(tmp_path, {"trainer": {"lrr": 1e-3, "dtype": "fp16"}})
    result, _ = invoke("config", "validate", job)
    err = assert_clean_user_error(result, "did you mean 'lr'?", "'float32', 'bfloat16' or 'auto' (got 'fp16')")
    assert [line.split(": ")[2] for line in err.strip().splitlines()] == ["trainer.dtype", "trainer.lrr"]


def test_engine_and_converter_lists_agree():
    """The preflight's architecture table is the converter's list, and each class is in the installed vLLM's
    registry (read as text: importing vLLM takes ~10 s); the CPU head sizes match its CPU attention backend."""
    from gspo_ray.trainer.model_spec import SUPPORTED_ARCHS

    assert set(ENGINE_ARCHITECTURES) == set(SUPPORTED_ARCHS)
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vllm is not installed")
    root = Path(spec.origin).parent
    registry = (root / "model_executor" / "models" / "registry.py").read_text()
    modules = {"deepseek_v3": "deepseek_v2"}  # vLLM's module of a model_type, where they differ
    for model_type, cls in ENGINE_ARCHITECTURES.items():
        assert f'"{cls}": ("{modules.get(model_type, model_type)}", "{cls}")' in registry, cls
    cpu_attn = (root / "v1" / "attention" / "backends" / "cpu_attn.py").read_text()
    assert f"return {list(CPU_HEAD_SIZES)}" in cpu_attn
    cpu_mla = (root / "v1" / "attention" / "backends" / "mla" / "cpu_mla.py").read_text()
    assert f"return [{CPU_MLA_LATENT}]" in cpu_mla  # the MLA latent kv_lora_rank + qk_rope_head_dim


def test_a_reward_that_raises_on_real_completions_is_refused_naming_the_input(tmp_path, plugins):
    """`ord(completion.strip())` scores the one-letter reference fine but raises on what a model really writes:
    the real command refuses it in one line naming that input (before: the dry call passed, the run exited 0)."""
    job = write_job(tmp_path, {"rollout": {"reward": {"fn": "pf_plugins:letter"}}},
                    rows=[{"prompt": "copy:7=", "reference": "7"}] * 3)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugins), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "gspo_ray.cli", "train", str(job)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.strip() == (
        "error: rollout.reward.fn: 'pf_plugins:letter' on a dry call with an empty completion (completion '', "
        "reference '7') raised TypeError at pf_plugins.py:7: ord() expected a character, but string of length 0 "
        "found"), proc.stderr


def test_the_dry_calls_try_what_models_write():
    """The texts the reward sees, as the tiny model's character tokenizer renders them (letters outside its
    alphabet drop out, so the sentence is the bare reference here; with a real tokenizer it is the sentence)."""
    from gspo_ray.models.tiny import build_tokenizer
    from gspo_ray.preflight.plugins import dry_inputs

    tok = build_tokenizer()
    eos = tok.eos_token_id
    assert [(text, ids[-1] == eos, stopped) for _, text, ids, stopped in dry_inputs(tok, "42", 6)] == [
        ("42", True, True), ("", True, True), ("42", True, True), ("pypopy", False, False),
        ("42<eos>", True, True)]
