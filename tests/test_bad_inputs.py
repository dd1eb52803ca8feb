"""The bad-input catalogue: generated broken job files, JSONL data, model directories and plug-ins.

Every one must end `gspo-ray config validate` (the preflight `train` runs first) cleanly: exit 2, only `error:`
lines naming the field / file (and line), no traceback, within a few seconds, and nothing written anywhere (the
command runs inside the example's own directory; Python's __pycache__ of an imported plug-in aside). The number
of inputs generated per category is printed on the terminal when the module ends.
"""
import contextlib
import json
import shutil
import string
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gspo_ray.cli import app
from gspo_ray.models.tiny import DEFAULT_ALPHABET, build_tokenizer, ensure_tiny_model

CATALOGUE: Counter = Counter()
SETTINGS = dict(deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
ROWS = [{"prompt": f"copy:{n}=", "reference": str(n)} for n in (12, 345, 6789, 10, 11)]
MAX_SECONDS = 5.0


@pytest.fixture(scope="module", autouse=True)
def report_catalogue(request):
    """Warm the imports the checks need (transformers alone takes 4 s), so MAX_SECONDS measures the checks;
    at the end, report the catalogue's size."""
    from transformers import AutoTokenizer  # noqa: F401

    from gspo_ray.models.tiny import build_config

    build_config("qwen3_moe", vocab_size=22)
    yield
    total = sum(CATALOGUE.values())
    line = f"bad-input catalogue: {total} generated inputs, all ended in exit 2 with error lines only: " + \
        ", ".join(f"{k} {v}" for k, v in sorted(CATALOGUE.items()))
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        print("\n" + line)  # on the terminal, also when output is captured


class Workspace:
    """A fresh directory per example: the job, its data and plug-ins live there, and the command runs in it."""

    def __init__(self, root: Path):
        self.dir = root
        self.job = {"name": "bad", "logging": {"out_dir": str(root / "runs")},
                    "data": {"source": "jsonl", "path": str(root / "train.jsonl")},
                    "rollout": {"max_new_tokens": 6, "max_model_len": 64}}
        self.write_rows("train.jsonl", ROWS)

    def write_rows(self, name: str, rows: list, raw: bytes = b"") -> Path:
        path = self.dir / name
        path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + raw)
        return path

    def set(self, dotted: str, value) -> None:
        node = self.job
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value

    def snapshot(self) -> set:
        return {p.relative_to(self.dir) for p in self.dir.rglob("*") if "__pycache__" not in p.parts}

    def validate(self, category: str, *expected: str, job_text: bytes | None = None) -> str:
        job = self.dir / "job.yaml"
        job.write_bytes(job_text if job_text is not None else yaml.safe_dump(self.job).encode())
        before = self.snapshot()
        start = time.perf_counter()
        with contextlib.chdir(self.dir):
            result = CliRunner().invoke(app, ["config", "validate", str(job)])
        seconds = time.perf_counter() - start
        err = result.stderr
        assert result.exit_code == 2, (category, result.exit_code, result.output, result.exception)
        assert "Traceback" not in result.output and err.strip(), result.output
        assert all(line.startswith("error: ") for line in err.strip().splitlines()), err
        for text in expected:
            assert text in err, (category, text, err)
        assert seconds < MAX_SECONDS, (category, seconds)
        assert self.snapshot() == before, "the preflight wrote something"
        CATALOGUE[category] += 1
        return err


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory):
    counter = iter(range(10**9))
    return lambda: Workspace(tmp_path_factory.mktemp(f"bad{next(counter)}", numbered=False))


# ---- job files -------------------------------------------------------------------------------------------------------
def _not_in(valid):
    return st.text(string.ascii_letters + "_-. ", min_size=1, max_size=12).filter(lambda s: s not in valid)


WRONG_VALUES = {  # field -> values pydantic cannot coerce into a valid one
    "rollout.group_size": st.sampled_from(["eight", 2.5, [8], {"n": 8}, None, 1, 0, -4]),
    "trainer.lr": st.sampled_from(["fast", [1e-3], {"v": 1}, -1.0, None]),
    "rollout.dtype": _not_in({"float32", "bfloat16"}),
    "algorithm.importance_sampling_level": _not_in({"token", "sequence", "sequence_token"}),
    "coordinator.mode": _not_in({"sync", "async"}),
    "coordinator.steps": st.sampled_from([0, -1, "many", 1.5, None, [3]]),
    "model.tiny.arch": _not_in({"qwen3_moe", "qwen2"}),
    "data.source": _not_in({"builtin", "jsonl"}),
    "data.task": _not_in({"copy", "add", "repeat", "sum", "sort", "guess"}),  # a task that does not exist
    "data.min_digits": st.sampled_from([0, -2, "two", None, 1.5]),
    "rollout.reward": st.sampled_from(["copy", 3, [1], True]),
    "rollout.reward.timeout_s": st.sampled_from([0, -1, "slow", None]),
    "rollout.top_p": st.sampled_from([0, 1.5, -0.1, "all"]),
    "trainer": st.sampled_from([5, "x", [1, 2]]),
}
SECTIONS = ["", "model", "data", "rollout", "rollout.reward", "trainer", "algorithm", "algorithm.advantage",
            "coordinator", "cluster", "logging"]
BAD_COMBINATIONS = [
    {"data.min_digits": 5, "data.max_digits": 3},
    {"trainer.num_workers": 3, "trainer.tp": 2},
    {"algorithm.advantage.per_token": True},
    {"rollout.max_new_tokens": 64},
    {"data.source": "jsonl", "data.path": None},
    {"model.path": "/nonexistent/model"},
    {"algorithm.aggregation": "token-mean"},
    {"coordinator.num_minibatches": 3},
    {"data.source": "builtin", "data.task": "guess"},
    {"model.tiny.top_k": 8},
    {"rollout.partial.segment_tokens": 8},
    {"data.eval_path": "/nonexistent/eval.jsonl"},
    {"trainer.micro_batch_tokens": 16},
]
BROKEN_SYNTAX = [b"rollout: [1, 2\n", b"trainer:\n\tlr: 1\n", b"a: b: c\n", b"- just\n- a list\n", b"42\n",
                 b"name: 'unterminated\n", b"key: @bad\n", b"!!python/object/apply:os.system ['true']\n",
                 b"name: \xff\xfe bad\n", b"rollout: {group_size: 8\n"]


@st.composite
def job_mutation(draw, kind: str):
    if kind == "wrong_type":
        field = draw(st.sampled_from(sorted(WRONG_VALUES)))
        return kind, {field: draw(WRONG_VALUES[field])}, field
    if kind == "unknown_key":
        section = draw(st.sampled_from(SECTIONS))
        key = draw(st.from_regex(r"[a-z][a-z_]{0,10}", fullmatch=True))
        if _is_field(section, key):
            key = key + "_zz"
        dotted = f"{section}.{key}" if section else key
        return kind, {dotted: 1}, dotted
    if kind == "combination":
        return kind, draw(st.sampled_from(BAD_COMBINATIONS)), None
    return kind, draw(st.sampled_from(BROKEN_SYNTAX)), None


def _is_field(section: str, key: str) -> bool:
    from gspo_ray.config import section_fields

    return key in section_fields(tuple(section.split(".")) if section else ())


@pytest.mark.parametrize("kind", ["wrong_type", "unknown_key", "combination", "syntax"])
@settings(max_examples=15, **SETTINGS)
@given(data=st.data())
def test_bad_job_files(workspaces, kind, data):
    kind, change, field = data.draw(job_mutation(kind))
    ws = workspaces()
    if kind == "syntax":
        ws.validate("job/syntax", "job.yaml", job_text=change)
        return
    for dotted, value in change.items():
        ws.set(dotted, value)
    ws.validate(f"job/{kind}", "job.yaml", *([f"{field}:"] if field else []))


def test_an_unknown_task_is_named_with_the_valid_ones(workspaces):
    from gspo_ray.data.tasks import TASKS

    ws = workspaces()
    ws.set("data.task", "multiply")
    err = ws.validate("job/unknown_task", "data.task:", "'multiply'")
    assert all(f"'{task}'" in err for task in TASKS), err


@pytest.mark.parametrize("change,expected", [
    ({"trainer.num_workers": 3, "trainer.cp": 2}, ["trainer.tp x trainer.cp (1 x 2)", "trainer.num_workers (3)"]),
    ({"trainer.num_workers": 2, "trainer.cp": 2, "trainer.micro_batch_tokens": 66},
     ["trainer.micro_batch_tokens (66)", "2 x trainer.cp (4)"]),
    ({"trainer.num_workers": 2, "trainer.cp": 2, "trainer.routing_replay": "R2"}, ["trainer.routing_replay"]),
    # the job's MoE (model.tiny qwen3_moe) keeps routing drift and router churn on: the preflight names them
    ({"trainer.num_workers": 2, "trainer.cp": 2}, ["trainer.cp=2", "trainer.routing_drift", "router_churn_every"]),
])
def test_context_parallel_refusals_name_their_fields(workspaces, change, expected):
    ws = workspaces()
    for dotted, value in change.items():
        ws.set(dotted, value)
    ws.validate("job/context_parallel", *expected)


# ---- JSONL data ------------------------------------------------------------------------------------------------------
BAD_PROMPTS = [3, 2.5, True, None, {"text": "copy:1="}, [1, 2], [], ""]
CHAT = [{"role": "user", "content": "copy:12="}]


JSONL_BREAKAGES = ["empty", "not_utf8", "bad_json", "not_object", "missing_field", "prompt_type",
                   "chat_without_template", "template_missing", "huge"]


@st.composite
def jsonl_breakage(draw, kind: str):
    """(kind, raw line bytes or None, extra job settings, fragments the error must hold, names a line?)"""
    if kind == "empty":
        return kind, draw(st.sampled_from([b"", b"\n", b"  \n\n"])), {}, ["has no rows"], False
    if kind == "not_utf8":
        bad = draw(st.sampled_from([b"\xff", b"\xfe\xfe", b"\xc3\x28", b"\x80abc"]))
        return kind, b'{"prompt": "copy:1' + bad + b'=", "reference": "1"}\n', {}, ["not UTF-8"], True
    if kind == "bad_json":
        line = draw(st.sampled_from(['{"prompt": ', "not json", "{'prompt': 'x'}", '{"prompt": "x",}', "{"]))
        return kind, line.encode() + b"\n", {}, ["not valid JSON"], True
    if kind == "not_object":
        value = draw(st.sampled_from([[1, 2], 7, "copy:1=", None, 2.5]))
        return kind, json.dumps(value).encode() + b"\n", {}, ["expected a JSON object"], True
    if kind == "missing_field":
        row = draw(st.sampled_from([{"prompt": "copy:1="}, {"reference": "1"}, {"question": "copy:1=", "answer": 1}]))
        return kind, json.dumps(row).encode() + b"\n", {}, ["row has no field"], True
    if kind == "prompt_type":
        row = {"prompt": draw(st.sampled_from(BAD_PROMPTS)), "reference": "1"}
        return kind, json.dumps(row).encode() + b"\n", {}, ["(data.prompt_field)"], True
    if kind == "chat_without_template":
        row = {"prompt": CHAT, "reference": "12"}
        return kind, json.dumps(row).encode() + b"\n", {}, ["holds chat messages", "apply_chat_template"], True
    if kind == "template_missing":  # the tiny model's tokenizer has no chat template
        row = {"prompt": draw(st.sampled_from([CHAT, "copy:12="])), "reference": "12"}
        return kind, json.dumps(row).encode() + b"\n", {"apply_chat_template": True}, ["no chat template"], False
    n = draw(st.integers(min_value=60, max_value=300_000))  # room is 64 - 6 = 58 tokens
    row = {"prompt": "copy:" + ("1234567890" * (n // 10 + 1))[:n] + "=", "reference": "1"}
    return kind, json.dumps(row).encode() + b"\n", {}, ["out of bounds", "58 tokens"], True


@pytest.mark.parametrize("kind", JSONL_BREAKAGES)
@settings(max_examples=5, **SETTINGS)
@given(data=st.data(), good_rows_before=st.integers(min_value=0, max_value=4), in_eval=st.booleans())
def test_bad_jsonl(workspaces, kind, data, good_rows_before, in_eval):
    kind, raw, data_settings, expected, names_line = data.draw(jsonl_breakage(kind))
    ws = workspaces()
    name, field = ("eval.jsonl", "data.eval_path") if in_eval else ("train.jsonl", "data.path")
    rows = [] if kind == "empty" else ROWS[:good_rows_before]
    path = ws.write_rows(name, rows, raw)
    ws.set(field, str(path))
    for key, value in data_settings.items():
        ws.set(f"data.{key}", value)
    if kind == "template_missing":  # fails on the tokenizer, before either file is tokenised
        field = "data.apply_chat_template"
    where = [f"{path}:{len(rows) + 1}"] if names_line else [str(path)] if field != "data.apply_chat_template" else []
    ws.validate(f"jsonl/{kind}", f"{field}:", *where, *expected)


# ---- model directories -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A good tiny Qwen2 (vocab 22) and a GPT-2 directory built locally with transformers."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("models")
    good = ensure_tiny_model("qwen2", root / "qwen2", seed=0)
    torch.manual_seed(0)
    gpt2 = root / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=22, n_positions=64, n_embd=64, n_layer=1, n_head=2)).save_pretrained(gpt2)
    build_tokenizer().save_pretrained(gpt2)
    return {"good": good, "gpt2": gpt2}


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _break_model(kind: str, d: Path, ws: Workspace, draw) -> list[str]:
    """Break the copy `d` of a good model (or the job around it) in one way; returns what the error must say."""
    weights, cfg = d / "model.safetensors", d / "config.json"
    if kind == "no_weights":
        weights.unlink()
        return ["no weights"]
    if kind == "bin_weights_only":
        weights.rename(d / "pytorch_model.bin")
        return ["no weights", "pytorch_model.bin"]
    if kind == "truncated_weights":
        data = weights.read_bytes()
        weights.write_bytes(data[: int(len(data) * draw(st.floats(0.0, 0.95)))])
        return ["model.safetensors is not a readable safetensors file"]
    if kind == "missing_shard":
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
        return ["missing shard", "model-00002-of-00002.safetensors"]
    if kind == "no_config":
        cfg.unlink()
        return ["model.path:", "config.json"]  # the job's own validator names it first
    if kind == "config_not_json":
        cfg.write_text(draw(st.sampled_from(["{", "not json", "[1, 2]", ""])))
        return ["config.json"]
    if kind == "model_type":
        _edit_json(cfg, model_type=draw(st.sampled_from(["gpt2", "mistral", "bert", "t5", "", None, 3])))
        return ["is not supported by the trainer's converter", "valid: qwen2, qwen3, qwen3_moe, llama"]
    if kind == "architectures":
        _edit_json(cfg, architectures=[draw(st.sampled_from(["LlamaForCausalLM", "Qwen2Model", "GPT2LMHeadModel"]))])
        return ["does not match model_type 'qwen2'", "Qwen2ForCausalLM"]
    if kind == "vocab_size":
        _edit_json(cfg, vocab_size=draw(st.integers(1, 200).filter(lambda v: v != 22)))
        return ["rows but config.json vocab_size"]
    if kind == "tokenizer_missing":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (d / name).unlink()
        return ["no tokenizer"]
    if kind == "tokenizer_mismatch":  # another tokenizer: the prompts' digits get ids past the embedding of 22
        (d / "tokenizer.json").unlink()
        build_tokenizer(string.ascii_lowercase + DEFAULT_ALPHABET).save_pretrained(d)
        return ["has no embedding", "vocab_size is 22"]
    if kind == "no_eos":
        _edit_json(d / "tokenizer_config.json", eos_token=None)
        return ["no eos_token"]
    if kind == "rope":
        _edit_json(cfg, rope_parameters={"rope_type": draw(st.sampled_from(["yarn", "linear", "dynamic"])),
                                         "factor": 2.0, "rope_theta": 10000.0})
        return ["rope type"]
    if kind == "hidden_act":
        _edit_json(cfg, hidden_act=draw(st.sampled_from(["gelu", "relu", "gelu_new"])))
        return ["hidden_act"]
    if kind == "head_size":
        _edit_json(cfg, num_attention_heads=4, num_key_value_heads=4)  # head size 64 / 4 = 16
        return ["head size 16", "vLLM's CPU attention"]
    if kind == "tensor_parallel":
        tp = draw(st.sampled_from([3, 4]))  # 2 heads
        ws.set("trainer.num_workers", tp)
        ws.set("trainer.tp", tp)
        return [f"tp={tp} must divide num_attention_heads=2"]
    if kind == "pipeline_layers":  # pipeline stages that do not divide the model's 2 layers
        pp = draw(st.sampled_from([3, 4]))
        ws.set("trainer.num_workers", pp)
        ws.set("trainer.pp", pp)
        return [f"trainer.pp ({pp}) must divide the model's 2 layers"]
    if kind == "tokenizer_max_length":  # vLLM caps the context at the tokenizer's model_max_length too
        _edit_json(d / "tokenizer_config.json", model_max_length=draw(st.integers(8, 63)))
        return ["rollout.max_model_len (64)", "tokenizer_config.json model_max_length"]
    ws.set("rollout.max_model_len", draw(st.integers(257, 4096)))  # max_model_len past the model's 256 positions
    return ["rollout.max_model_len", "max_position_embeddings (256)"]


MODEL_BREAKAGES = ["bin_weights_only", "truncated_weights", "missing_shard", "no_config",
                   "config_not_json", "model_type", "architectures", "vocab_size", "tokenizer_missing",
                   "tokenizer_mismatch", "no_eos", "rope", "hidden_act", "head_size", "tensor_parallel",
                   "pipeline_layers", "tokenizer_max_length", "max_model_len", "gpt2"]


@pytest.mark.parametrize("kind", MODEL_BREAKAGES)
@settings(max_examples=2, **SETTINGS)
@given(data=st.data())
def test_bad_model_dirs(workspaces, model_dirs, kind, data):
    ws = workspaces()
    d = ws.dir / "model"
    shutil.copytree(model_dirs["gpt2" if kind == "gpt2" else "good"], d)
    expected = ["'gpt2'", "valid: qwen2"] if kind == "gpt2" else _break_model(kind, d, ws, data.draw)
    ws.set("model", {"path": str(d)})
    ws.validate(f"model/{kind}", *expected)


# ---- plug-ins --------------------------------------------------------------------------------------------------------
REWARD_BODIES = {  # kind -> (module source around `fn`, reward.kwargs, what the error says)
    "missing_attribute": ("def other(completion, reference):\n    return 1.0\n", {}, "has no attribute 'fn'"),
    "not_callable": ("fn = 3\n", {}, "not callable"),
    "one_positional": ("def fn(completion):\n    return 1.0\n", {}, "must take (completion, reference)"),
    "required_keyword": ("def fn(completion, reference, *, needed):\n    return 1.0\n", {}, "requires ['needed']"),
    "unknown_kwargs": ("def fn(completion, reference):\n    return 1.0\n", {"bogus": 1}, "takes no argument"),
    "context_kwargs": ("def fn(completion, reference, **kw):\n    return 1.0\n", {"eos_found": 1}, "may not set"),
}
RETURNS = ["'good'", "None", "[1.0]", "{'score': 1.0}", "float('nan')", "float('inf')", "{'reward': 1.0, 'x': 'y'}",
           "(1.0,)", "{'reward': 'high'}", "{'reward': 1.0, 'token_rewards': [1.0]}"]
RAISES = ["ValueError('boom')", "ZeroDivisionError", "KeyError('reference')", "SystemExit(3)", "AssertionError"]
IMPORT_FAILURES = ["raise ImportError('no torch_scatter')", "import pf_not_installed_anywhere", "def (:\n",
                   "raise RuntimeError('bad import')", "1 / 0"]
ENV = "rollout.multi_turn.env:"
ENV_CASES = {  # kind -> (class source, what the error says)
    "not_a_class": ("def Env(tokenizer):\n    return None\n", [ENV, "expected a class"]),
    "missing_step": ("class Env:\n    def __init__(self, tokenizer):\n        pass\n"
                     "    def reset(self, prompt, seed):\n        return []\n", [ENV, "has no method(s) ['step']"]),
    "constructor_signature": ("class Env:\n    def __init__(self):\n        pass\n{methods}",
                              ["rollout.multi_turn.kwargs:", "does not fit its signature"]),
    "constructor_raises": ("class Env:\n    def __init__(self, tokenizer):\n        raise ValueError('no env')\n"
                           "{methods}", [ENV, "raised ValueError at ", ": no env"]),
    "reset_signature": ("class Env:\n    def __init__(self, tokenizer):\n        pass\n"
                        "    def reset(self):\n        return []\n    def step(self, a, t):\n        pass\n",
                        [ENV, "does not take the protocol's arguments"]),
}
ENV_METHODS = ("    def reset(self, prompt, seed):\n        return []\n"
               "    def step(self, action_ids, action_text):\n        pass\n")
RESET_RETURNS = ["{'obs': 1}", "2.5", "None", "['a']", "[-1]", "[10**6]", "'\\u00e9'", "True", "[1.5]"]


PLUGIN_BREAKAGES = [("reward", k) for k in ("missing_module", "import_fails", "signature", "returns", "raises",
                                             "hangs")] + \
    [("env", k) for k in ("missing_module", "import_fails", "protocol", "reset_returns", "reset_hangs")]


@st.composite
def plugin_breakage(draw, target: str, kind: str):
    """(category, module source or None, job settings, fragments the error must hold)"""
    fld = "rollout.reward.fn" if target == "reward" else "rollout.multi_turn.env"
    if kind == "missing_module":
        return f"{target}/{kind}", None, {}, [f"{fld}:", "no module named"]
    if kind == "import_fails":
        return f"{target}/{kind}", draw(st.sampled_from(IMPORT_FAILURES)) + "\n", {}, [f"{fld}:", "failed"]
    if kind == "signature":
        sub = draw(st.sampled_from(sorted(REWARD_BODIES)))
        source, kwargs, says = REWARD_BODIES[sub]
        return f"reward/{sub}", source, {"rollout.reward.kwargs": kwargs}, ["rollout.reward", says]
    if kind == "returns":
        source = f"def fn(completion, reference, **kw):\n    return {draw(st.sampled_from(RETURNS))}\n"
        return f"reward/{kind}", source, {}, [f"{fld}:", "dry call"]
    if kind == "raises":
        source = f"def fn(completion, reference, **kw):\n    raise {draw(st.sampled_from(RAISES))}\n"
        return f"reward/{kind}", source, {}, [f"{fld}:", "dry call", "raised"]
    if kind == "hangs":
        source = "import time\ndef fn(completion, reference, **kw):\n    time.sleep(10)\n"
        return f"reward/{kind}", source, {"rollout.reward.timeout_s": 0.3}, ["did not return within 0.3 s"]
    if kind == "protocol":
        sub = draw(st.sampled_from(sorted(ENV_CASES)))
        source, says = ENV_CASES[sub]
        return f"env/{sub}", source.replace("{methods}", ENV_METHODS), {}, says
    if kind == "reset_returns":
        value = draw(st.sampled_from(RESET_RETURNS))
        source = ("class Env:\n    def __init__(self, tokenizer):\n        pass\n"
                  f"    def reset(self, prompt, seed):\n        return {value}\n"
                  "    def step(self, action_ids, action_text):\n        pass\n")
        return f"env/{kind}", source, {}, [f"{fld}:", "Env.reset", "valid: token ids"]
    source = ("import time\nclass Env:\n    def __init__(self, tokenizer):\n        pass\n"
              "    def reset(self, prompt, seed):\n        time.sleep(10)\n"
              "    def step(self, action_ids, action_text):\n        pass\n")
    return f"env/{kind}", source, {"rollout.multi_turn.step_timeout_s": 0.3}, ["did not return within 0.3 s"]


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_plugins")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        yield root


@pytest.mark.parametrize("target,kind", PLUGIN_BREAKAGES)
@settings(max_examples=10, **SETTINGS)
@given(data=st.data())
def test_bad_plugins(workspaces, plugin_path, target, kind, data):
    category, source, job_settings, expected = data.draw(plugin_breakage(target, kind))
    ws = workspaces()
    module = f"pf_bad_{ws.dir.name}"  # a fresh name per example: nothing is cached in sys.modules
    if source is not None:
        (plugin_path / f"{module}.py").write_text(source)
    target = "fn" if category.startswith("reward") else "Env"
    path = f"{module if source is not None else 'pf_missing_' + ws.dir.name}:{target}"
    if category.startswith("reward"):
        ws.set("rollout.reward.fn", path)
    else:
        ws.set("rollout.multi_turn", {"env": path})
    for dotted, value in job_settings.items():
        ws.set(dotted, value)
    ws.validate(category, *expected)
