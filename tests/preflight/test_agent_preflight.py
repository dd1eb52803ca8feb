"""The preflight of `rollout.agent`: an agent that does not resolve, is not an async callable of (client, task), asks
the endpoint for something it refuses, or returns no reward fails `config validate` with exit 2 and one line naming
the field; a good agent passes after one dry episode against the stand-in endpoint (the real one needs an engine)."""
from __future__ import annotations

import json
import textwrap

import pytest
import yaml
from typer.testing import CliRunner

from gspo_ray.cli import app

AGENTS = '''
async def good(client, task, bonus=0.0):
    reply = await client.chat.completions.create(model=task["model"], max_tokens=4,
                                                 messages=[{"role": "user", "content": task["prompt"]}])
    return {"reward": float(reply.choices[0].message.content == task["reference"]) + bonus}

def not_async(client, task):
    return 1.0

async def no_task(client):
    return 1.0

async def hot(client, task):
    await client.chat.completions.create(model=task["model"], temperature=0.3,
                                         messages=[{"role": "user", "content": task["prompt"]}])
    return 1.0

async def no_reward(client, task):
    return "done"
'''


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("agent_preflight")  # one tiny model and data file for the module
    (tmp_path / "pf_agents.py").write_text(textwrap.dedent(AGENTS))
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(tmp_path))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"copy:{n}=", "reference": str(n)}) + "\n" for n in (12, 345)))

    def write(agent: dict) -> str:
        cfg = {"name": "pf", "logging": {"out_dir": str(tmp_path / "runs")},
               "data": {"source": "jsonl", "path": str(data)},
               "rollout": {"max_new_tokens": 6, "max_model_len": 64, "agent": agent}}
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return str(path)

    yield write
    mp.undo()


def _validate(path: str):
    return CliRunner().invoke(app, ["config", "validate", path])


@pytest.mark.parametrize("fn, expected", [
    ("no_such_pkg.agents:solve", "rollout.agent.fn: no module named 'no_such_pkg'"),
    ("pf_agents:not_async", "rollout.agent.fn: 'pf_agents:not_async' is not an async callable"),
    ("pf_agents:no_task", "rollout.agent.fn: 'pf_agents:no_task'(client) does not take (client, task"),
    ("pf_agents:hot", "the endpoint refused a request: temperature: temperature 0.3 differs from the job's"),
    ("pf_agents:no_reward", "the agent returned reward str"),
])
def test_a_bad_agent_fails_the_preflight_naming_the_field(job, fn, expected):
    result = _validate(job({"fn": fn}))
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" not in result.output and expected in result.stderr, result.stderr
    assert result.stderr.startswith("error: rollout.agent.fn:")


def test_a_good_agent_passes_after_a_dry_episode(job):
    result = _validate(job({"fn": "pf_agents:good", "kwargs": {"bonus": 0.5}}))
    assert result.exit_code == 0, (result.output, result.exception)
    assert "pf_agents:good: 1.5 after 1 call(s) on a dry episode" in result.output


@pytest.mark.parametrize("extra, expected", [
    ({"rollout": {"multi_turn": {"env": "gspo_ray.envs.guess:GuessNumberEnv"}}},
     "rollout.agent and rollout.multi_turn are both set"),
    ({"rollout": {"partial": {"segment_tokens": 300}}},
     "rollout.partial.segment_tokens (300) must be below rollout.agent.max_total_tokens (256)"),
    ({"trainer": {"routing_replay": "R3"}}, "trainer.routing_replay 'R3' cannot be combined with rollout.agent"),
    ({"data": {"apply_chat_template": True}}, "data.apply_chat_template with rollout.agent")])
def test_what_agent_episodes_cannot_do_yet_is_refused(job, tmp_path, extra, expected):
    cfg = yaml.safe_load(open(job({"fn": "pf_agents:good"})))
    for section, values in extra.items():
        cfg.setdefault(section, {}).update(values)
    (tmp_path / "both.yaml").write_text(yaml.safe_dump(cfg))
    result = _validate(str(tmp_path / "both.yaml"))
    assert result.exit_code == 2 and expected in result.stderr, result.stderr
