"""The eval summary numbers (gspo_ray/coordinator/evaluation.py) on hand-made groups."""
from __future__ import annotations

import json

import pytest

from gspo_ray.coordinator.evaluation import describe_eval, eval_metrics, run_eval, write_eval_samples
from gspo_ray.data.records import Group, Prompt, Sample


def _sample(i: int, reward: float, n_tok: int, finish: str = "stop", info=None, failed=None) -> Sample:
    return Sample(prompt_uid="p", sample_index=i, prompt_ids=[1], completion_ids=[5] * n_tok,
                  logprobs=[-0.1] * n_tok, loss_mask=[1] * n_tok, versions=[0] * n_tok, finish_reason=finish,
                  reward=reward, reward_info=info or {}, failed=failed)


def _groups() -> list[Group]:
    # prompt a: rewards 1, 0, 0.5, 1 -> 2 of 4 pass (threshold 1.0); prompt b: none pass; prompt c: 1 of 4 and one
    # failed sample (not scored, never passes)
    a = [_sample(0, 1.0, 2), _sample(1, 0.0, 4, "length"), _sample(2, 0.5, 2), _sample(3, 1.0, 2)]
    b = [_sample(i, 0.25, 2) for i in range(4)]
    c = [_sample(0, 1.0, 2), _sample(1, 0.0, 2), _sample(2, 0.0, 2), _sample(3, 0.0, 2, failed="timeout")]
    return [Group(prompt=Prompt(uid=u, prompt_ids=[1], reference="x"), samples=s) for u, s in zip("abc", (a, b, c))]


def test_pass_at_1_is_the_mean_share_pass_at_n_any():
    m = eval_metrics(_groups())
    # scored rewards: a 2.5, b 1.0, c 1.0 (failed one excluded) over 11 samples
    assert m["eval/reward"] == pytest.approx(4.5 / 11)
    assert m["eval/failed"] == 1
    assert m["eval/pass@1"] == pytest.approx((2 / 4 + 0 + 1 / 4) / 3)
    assert m["eval/pass@n"] == pytest.approx(2 / 3)
    assert m["eval/mean_len"] == pytest.approx(26 / 12)  # 11 samples of 2 tokens, one of 4
    assert m["eval/finish_length"] == pytest.approx(1 / 12) and m["eval/finish_stop"] == pytest.approx(11 / 12)
    assert m["eval/n"] == 4 and m["eval/prompts"] == 3
    assert "pass@4" in describe_eval(m)


def test_exact_from_the_reward_decides_passing():
    # copy_reward style: reward 0.8 without an exact answer does not pass even at threshold 0.5
    g = [Group(prompt=Prompt(uid="p", prompt_ids=[1]), samples=[_sample(0, 0.8, 1, info={"exact": 0.0}),
                                                                _sample(1, 2.0, 1, info={"exact": 1.0})])]
    m = eval_metrics(g, pass_threshold=0.5)
    assert m["eval/pass@1"] == 0.5 and m["eval/exact"] == 0.5


def test_run_eval_refuses_several_greedy_samples_and_writes_lines(tmp_path):
    with pytest.raises(ValueError, match="temperature"):
        run_eval(lambda prompts, n, temperature: ([], {}), [], n=4, temperature=0.0)
    path = write_eval_samples(tmp_path / "s.jsonl", _groups(), decode=lambda ids: "x" * len(ids))
    rows = [json.loads(line) for line in path.open()]
    assert len(rows) == 12 and rows[1]["completion"] == "xxxx" and rows[0]["passed"] and not rows[1]["passed"]


def test_early_stop_reads_the_named_metric_and_names_a_missing_one():
    from gspo_ray.config import ConfigError, load_config
    from gspo_ray.coordinator.evaluation import early_stop_value

    logged = {"eval/reward": 0.99, "eval/exact": 0.94, "rollout/reward_mean": 0.5}
    assert early_stop_value(logged, "eval/exact") == 0.94  # the repeat recipe's stop: exact, not the mean reward
    assert early_stop_value({"train/loss": 1.0}, "eval/exact") is None  # a step without an evaluation
    with pytest.raises(ConfigError, match=r"coordinator\.early_stop_metric: 'eval/solved' .*eval/exact, eval/reward"):
        early_stop_value(logged, "eval/solved")
    with pytest.raises(ConfigError, match=r"coordinator\.early_stop_metric"):  # not a held-out metric at all
        load_config("gspo_ray/recipes/tiny_moe.yaml", ["coordinator.early_stop_metric=rollout/reward_mean"])
