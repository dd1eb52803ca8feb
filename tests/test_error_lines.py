"""Errors that teach, each checked as its exact one line through `gspo-ray config validate` (in-process): where a
bad key was set (the YAML file or the command-line override), the gspo-ray field for a TRL or verl name, a
reward module that is not importable (and how to make it so), and a reward written for a batch (TRL) or for verl's
compute_score signature. The dry call's own error line is in test_preflight.py."""
import json

import pytest
import yaml
from typer.testing import CliRunner

from gspo_ray.cli import app


def _job(tmp_path, **sections):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"copy:{n}=", "reference": str(n)}) + "\n" for n in (12, 345)))
    job = {"name": "lines", "logging": {"out_dir": str(tmp_path / "runs")},
           "data": {"source": "jsonl", "path": str(data)}, "rollout": {"max_new_tokens": 6, "max_model_len": 64}}
    for section, values in sections.items():
        job.setdefault(section, {}).update(values)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _error_line(*args) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("key,line", [
    ("trainer.learning_rate=1e-5", "trainer.learning_rate: unknown key; TRL's learning_rate is trainer.lr here"),
    ("rollout.num_generations=8", "rollout.num_generations: unknown key; TRL's num_generations is rollout.group_size "
                                  "here (completions per prompt)"),
    ("trainer.per_device_train_batch_size=8", "trainer.per_device_train_batch_size: unknown key; TRL's "
     "per_device_train_batch_size is coordinator.prompts_per_step here (groups per step; completions per step = "
     "prompts_per_step x rollout.group_size; trainer.micro_batch_size sets the micro-batch)"),
    ("rollout.max_completion_length=64", "rollout.max_completion_length: unknown key; TRL's max_completion_length is "
                                         "rollout.max_new_tokens here"),
    ("algorithm.epsilon=0.2", "algorithm.epsilon: unknown key; TRL's epsilon is algorithm.eps_low here (and "
                              "algorithm.eps_high)"),
    ("trainer.beta=0.04", "trainer.beta: unknown key here; the field is algorithm.beta"),
    ("algorithm.kl_loss_coef=0.01", "algorithm.kl_loss_coef: unknown key; verl's kl_loss_coef is algorithm.beta here"),
    ("rollout.n=8", "rollout.n: unknown key; verl's n is rollout.group_size here (completions per prompt)"),
])
def test_an_override_names_itself_and_a_peer_name_gets_our_field(tmp_path, key, line):
    assert _error_line("config", "validate", _job(tmp_path), key) == f"error: command-line override {key!r}: {line}"


def test_a_bad_key_in_the_file_names_the_file(tmp_path):
    job = _job(tmp_path, trainer={"learning_rate": 1e-5})
    assert _error_line("config", "validate", job) == (
        f"error: {job}: trainer.learning_rate: unknown key; TRL's learning_rate is trainer.lr here")


def test_a_reward_module_not_on_the_path_says_how_to_make_it_importable(tmp_path, monkeypatch):
    (tmp_path / "letter_reward.py").write_text("def reward(completion, reference):\n    return 0.0\n")
    monkeypatch.chdir(tmp_path)  # the module sits in the current directory, which gspo-ray does not search
    job = _job(tmp_path, rollout={"reward": {"fn": "letter_reward:reward"}})
    assert _error_line("config", "validate", job) == (
        "error: rollout.reward.fn: no module named 'letter_reward' (from 'letter_reward:reward'); the module must be "
        "importable: letter_reward.py is in the current directory, which gspo-ray does not search: run with "
        "PYTHONPATH=. (on a cluster: cluster.runtime_env working_dir or env_vars.PYTHONPATH), or pip install it")


@pytest.mark.parametrize("source,line", [
    ("def reward(completions, **kwargs):\n    return [0.0 for _ in completions]\n",
     "error: rollout.reward.fn: 'reward' must take (completion, reference) positionally and is called once per "
     "sample (one completion's text, not a batch of them as TRL passes); its signature is (completions, **kwargs); "
     "protocol: fn(completion, reference, **context) -> float | dict (docs/real-models.md#the-reward-protocol)"),
    ("def reward(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n",
     "error: rollout.reward.fn: 'reward' is called as fn(completion, reference, **context), once per sample; its "
     "signature (data_source, solution_str, ground_truth, extra_info=None) needs more positional arguments "
     "(verl's compute_score(data_source, solution_str, ground_truth, extra_info) becomes fn(solution_str, "
     "ground_truth, *, meta): docs/real-models.md); protocol: fn(completion, reference, **context) -> float | dict "
     "(docs/real-models.md#the-reward-protocol)"),
], ids=["trl_batch", "verl_compute_score"])
def test_a_reward_of_another_protocol_is_told_it_is_called_once_per_sample(tmp_path, monkeypatch, source, line):
    module = f"peer_reward_{len(source)}"  # one module per case (imports are cached)
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    job = _job(tmp_path, rollout={"reward": {"fn": f"{module}:reward"}})
    assert _error_line("config", "validate", job) == line
