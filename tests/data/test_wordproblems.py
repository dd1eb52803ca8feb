"""The generated word-problem task: deterministic, disjoint splits, answers that follow from the stated arithmetic,
written by `gspo-ray data make` in verl's parquet layout and as TRL datasets that the loaders read back."""
import re

import pytest
from typer.testing import CliRunner

from gspo_ray.cli import app
from gspo_ray.data.sources import read_rows
from gspo_ray.data.wordproblems import DATA_SOURCE, best_constant_guess, build_wordproblem_splits
from gspo_ray.envs.rewards import math_verify_reward


def test_splits_are_deterministic_disjoint_and_stable_under_num_train():
    train, held_out = build_wordproblem_splits(num_train=500, num_eval=64, seed=3)
    again, held_again = build_wordproblem_splits(num_train=500, num_eval=64, seed=3)
    assert train == again and held_out == held_again
    assert not {p.question for p in train} & {p.question for p in held_out}
    assert len({p.question for p in train}) == 500
    assert build_wordproblem_splits(num_train=50, num_eval=64, seed=3)[1] == held_out  # held-out first
    assert build_wordproblem_splits(num_train=50, num_eval=64, seed=4)[1] != held_out


def test_answers_follow_from_the_arithmetic_and_ops_are_counted():
    train, _ = build_wordproblem_splits(num_train=300, num_eval=8, seed=0, max_value=9)
    for p in train:
        lhs, rhs = p.solution.split(" = ")
        assert re.fullmatch(r"[\d +\-*/()]+", lhs) and eval(lhs) == p.answer == int(rhs)  # plain arithmetic
        assert len(re.findall(r"[+\-*/]", lhs)) == p.ops and isinstance(p.answer, int) and p.answer > 0
        assert p.prompt.endswith('finish with a last line of the form "The answer is N." with N a number.')
    assert {p.ops for p in train} == {2, 3}
    assert {p.ops for p in build_wordproblem_splits(num_train=50, num_eval=8, min_ops=2, max_ops=2)[0]} == {2}
    with pytest.raises(ValueError, match="need 2 <= min_ops <= max_ops <= 3"):
        build_wordproblem_splits(min_ops=1)


def test_data_make_writes_verl_parquet_and_trl_datasets(tmp_path):
    result = CliRunner().invoke(app, ["data", "make", "wordproblems", "--out", str(tmp_path), "--num-train", "40",
                                      "--num-eval", "8"])
    assert result.exit_code == 0, result.output
    train = read_rows(tmp_path / "train.parquet", "parquet", "prompt", "reward_model.ground_truth", True)
    test = read_rows(tmp_path / "test.parquet", "parquet", "prompt", "reward_model.ground_truth", True)
    assert (len(train), len(test)) == (40, 8)
    assert train[0].fields["data_source"] == DATA_SOURCE and train[0].fields["extra_info"]["split"] == "train"
    trl = read_rows(tmp_path / "trl" / "test", "hf_disk", "prompt", "solution", True)
    assert [(r.prompt, r.reference) for r in trl] == [(r.prompt, r.reference) for r in test]
    for r in test:  # the stated answer form earns the reward, a wrong number does not
        assert math_verify_reward(f"So we get it.\nThe answer is {r.reference}.", r.reference)["reward"] == 1.0
        assert math_verify_reward(f"The answer is {int(r.reference) + 1}.", r.reference)["reward"] == 0.0
    bad = CliRunner().invoke(app, ["data", "make", "riddles", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and bad.stderr.strip() == "error: task 'riddles' unknown; valid: wordproblems"


def test_data_make_oneline_instruction_and_unknown_instruction(tmp_path):
    result = CliRunner().invoke(app, ["data", "make", "wordproblems", "--out", str(tmp_path), "--num-train", "10",
                                      "--num-eval", "4", "--instruction", "oneline"])
    assert result.exit_code == 0, result.output
    rows = read_rows(tmp_path / "test.parquet", "parquet", "prompt", "reward_model.ground_truth", True)
    _, held_out = build_wordproblem_splits(num_train=10, num_eval=4)
    assert [r.prompt[0]["content"] for r in rows] == [
        f'{p.question}\nWrite the calculation as one line of arithmetic, then a last line of the form "The answer is '
        f'N."' for p in held_out]  # the same problems as the default, only the instruction differs
    bad = CliRunner().invoke(app, ["data", "make", "wordproblems", "--out", str(tmp_path / "x"), "--instruction",
                                   "terse"])
    assert bad.exit_code == 2 and bad.stderr.strip() == "error: instruction 'terse' unknown; valid: reason, oneline"
    assert not (tmp_path / "x").exists()


def test_no_answer_value_takes_more_than_its_share_of_a_split(tmp_path):
    """Uncapped, "1" was 8 of 64 held-out answers and a policy learned to print it; capped at 4%, a constant
    guess scores at most ceil(0.04 * n) / n of each split."""
    train, held_out = build_wordproblem_splits(num_train=1000, num_eval=64, seed=0)
    assert best_constant_guess(held_out)[1] <= 3 / 64 and best_constant_guess(train)[1] <= 40 / 1000
    uncapped = build_wordproblem_splits(num_train=1000, num_eval=64, seed=0, max_answer_share=1.0)[1]
    assert best_constant_guess(uncapped)[1] > 3 / 64  # the cap is what keeps it down
    answer, share = best_constant_guess(held_out)
    answers = [p.answer for p in held_out]
    assert share == answers.count(answer) / 64 == max(map(answers.count, answers)) / 64
    with pytest.raises(ValueError, match="need 0 < max_answer_share <= 1, got 0"):
        build_wordproblem_splits(max_answer_share=0)
    result = CliRunner().invoke(app, ["data", "make", "wordproblems", "--out", str(tmp_path), "--num-train", "100",
                                      "--num-eval", "16"])
    answer, share = best_constant_guess(build_wordproblem_splits(num_train=100, num_eval=16)[1])
    assert result.exit_code == 0 and share == 1 / 16
    assert f"test  16 problems; the best constant guess ({answer}) scores pass@1 0.062" in result.output
