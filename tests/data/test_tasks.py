"""Built-in task generators: exact strings, determinism, a held-out set disjoint from training (copy/add) or
balanced over every secret (guess)."""
from collections import Counter

import pytest

from gspo_ray.data.tasks import DIGIT_TASKS, TASKS, build_task_splits, task_space_size
from gspo_ray.models.tiny import DEFAULT_ALPHABET


@pytest.mark.parametrize("task", ["copy", "add"])  # the tiny tokenizer's tasks; repeat is for real tokenizers
def test_examples_are_well_formed(task):
    train, held_out = build_task_splits(task, num_train=500, num_eval=32, seed=0, min_digits=1, max_digits=3)
    assert len(train) == 500 and len(held_out) == 32
    for e in train + held_out:
        assert set(e.prompt) <= set(DEFAULT_ALPHABET) and e.prompt.endswith("=")
        body = e.prompt[:-1]
        if task == "copy":
            assert body == "copy:" + e.reference and 1 <= len(e.reference) <= 3
        else:
            a, b = body.split("+")
            assert int(a) + int(b) == int(e.reference)
            assert all(1 <= len(x) <= 3 and (x == "0" or not x.startswith("0")) for x in (a, b))


def test_repeat_numbers_have_the_digit_count_and_no_leading_zero():
    assert "repeat" in DIGIT_TASKS
    train, held_out = build_task_splits("repeat", num_train=300, num_eval=16, seed=0, min_digits=4, max_digits=8)
    for e in train + held_out:
        assert e.prompt == f"Repeat exactly: {e.reference}"
        assert 4 <= len(e.reference) <= 8 and e.reference.isdigit() and not e.reference.startswith("0")
    assert {e.prompt for e in train}.isdisjoint(e.prompt for e in held_out)


def test_hand_checked_strings():
    train, _ = build_task_splits("copy", num_train=50, num_eval=4, seed=0, min_digits=4, max_digits=4)
    assert all(len(e.reference) == 4 and e.prompt == f"copy:{e.reference}=" for e in train)
    train, _ = build_task_splits("add", num_train=50, num_eval=4, seed=0, min_digits=2, max_digits=2)
    e = train[0]
    a, b = map(int, e.prompt[:-1].split("+"))
    assert e.reference == str(a + b) and 10 <= a <= 99 and 10 <= b <= 99


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_and_seed_dependent(task):
    a = build_task_splits(task, 300, 16, seed=1)
    assert a == build_task_splits(task, 300, 16, seed=1)
    assert a != build_task_splits(task, 300, 16, seed=2)


@pytest.mark.parametrize("task, min_d, max_d", [("copy", 1, 4), ("add", 1, 2), ("copy", 3, 4), ("add", 3, 4),
                                                ("repeat", 4, 8), ("sum", 2, 2), ("sum", 2, 3), ("sort", 4, 6)])
def test_held_out_is_disjoint_and_stable(task, min_d, max_d):
    train, held_out = build_task_splits(task, 5_000, 64, seed=0, min_digits=min_d, max_digits=max_d)
    prompts = [e.prompt for e in train]
    assert len(set(prompts)) == len(prompts)                                   # no duplicates in training
    assert not set(prompts) & {e.prompt for e in held_out}                     # no train/eval overlap
    # The eval set comes from its own seed stream: it does not depend on how much training data is drawn.
    _, again = build_task_splits(task, 100, 64, seed=0, min_digits=min_d, max_digits=max_d)
    assert again == held_out


def test_every_length_is_trained_on_and_small_spaces_exhaust():
    # copy 1..4 digits: 10 + 100 + 1000 + 10000 = 11110 prompts.
    assert task_space_size("copy", 1, 4) == 11_110
    # add 1..2 digits: operands 0..99 (10 one-digit + 90 two-digit) -> 100 * 100 = 10000 pairs.
    assert task_space_size("add", 1, 2) == 10_000
    train, held_out = build_task_splits("copy", 100_000, 64, seed=0, min_digits=1, max_digits=4)
    assert len(train) == 11_110 - 64                                           # everything that is left
    lengths = Counter(len(e.reference) for e in held_out)
    assert lengths[1] <= 2                                                     # at most a quarter of 10
    assert sum(len(e.reference) == 1 for e in train) >= 8                      # one-digit strings still train
    # Digit counts are drawn uniformly, so short strings are not swamped: ~1/4 of the first 400 are 2-digit
    # (1-digit runs out after 8). Uniform over strings would give 100/11110 < 1%.
    assert Counter(len(e.reference) for e in train[:400])[2] > 60


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="unknown task 'mul'; valid: copy, add, repeat, sum, sort, guess"):
        build_task_splits("mul", 10, 2)
    with pytest.raises(ValueError, match="min_digits"):
        build_task_splits("copy", 10, 2, min_digits=3, max_digits=2)
    with pytest.raises(ValueError, match="data.num_eval=5 is too many"):
        build_task_splits("copy", 10, 5, min_digits=1, max_digits=1)       # 10 prompts, eval may take 2


def test_guess_train_secrets_are_uniform_and_eval_is_balanced():
    train, held_out = build_task_splits("guess", num_train=2_000, num_eval=25, seed=0, guess_low=3, guess_high=7)
    assert {e.prompt for e in train + held_out} == {"3-7:"}                   # one prompt; the secret differs
    assert set(DEFAULT_ALPHABET) >= set("3-7:")
    counts = Counter(int(e.reference) for e in train)
    assert set(counts) == {3, 4, 5, 6, 7} and min(counts.values()) > 300      # ~400 each of 2000
    # Eval: every secret exactly 5 times (25 = 5 x 5), so a greedy eval averages over secrets evenly.
    assert Counter(e.reference for e in held_out) == {str(s): 5 for s in range(3, 8)}
    # Its own seed stream: independent of num_train, different per seed, reproducible.
    assert build_task_splits("guess", 10, 25, seed=0, guess_low=3, guess_high=7)[1] == held_out
    assert build_task_splits("guess", 2_000, 25, seed=0, guess_low=3, guess_high=7) == (train, held_out)
    assert build_task_splits("guess", 10, 5, seed=1, guess_low=3, guess_high=7)[1] != held_out[:5]
    assert task_space_size("guess", guess_low=3, guess_high=7) == 5


def test_guess_prompt_matches_the_environment():
    from gspo_ray.envs.guess import build_guess_prompts
    from gspo_ray.models.tiny import build_tokenizer

    train, _ = build_task_splits("guess", 1, 0, guess_low=0, guess_high=9)
    assert train[0].prompt == build_guess_prompts(build_tokenizer(), 1, low=0, high=9)[0].text == "0-9:"
    with pytest.raises(ValueError, match="guess_low <= data.guess_high, got 5 and 2"):
        build_task_splits("guess", 10, 2, guess_low=5, guess_high=2)


def test_chat_tasks_read_as_questions_with_exact_answers():
    train, _ = build_task_splits("sum", 50, 8, seed=0, min_digits=2, max_digits=3)
    for e in train:
        a, b = map(int, e.prompt.removeprefix("What is ").split("?")[0].split(" + "))
        assert e.reference == str(a + b) and 10 <= min(a, b) and max(a, b) <= 999
    train, _ = build_task_splits("sort", 50, 8, seed=0, min_digits=5, max_digits=5)
    for e in train:
        digits = e.prompt.removeprefix("Sort the digits ").split(" from")[0].split(" ")
        assert len(digits) == 5 and e.reference == "".join(sorted(digits))
