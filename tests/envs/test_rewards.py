"""Reward functions: hand-worked numbers, the stopping rule, and the unbounded-CER outlier of seeds/002 §5."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo_ray.algo import compute_group_advantages
from gspo_ray.envs.rewards import (
    answer_number_reward,
    cer_reward,
    compute_cer,
    compute_edit_distance,
    compute_tail_repeats,
    copy_reward,
    exact_match,
    repeat_chars_reward,
    repeat_reward,
)


@pytest.mark.parametrize("completion, eos, expected", [
    ("4821", True, 2.0),           # 4 chars + EOS slot right = 5/5, + exact bonus 1
    ("4821", False, 0.8),          # ran to the token limit: EOS slot wrong -> 4/5, no bonus
    ("4831", True, 0.8),           # 4,8,_,1 + EOS = 4/5
    ("48215", True, 4 / 6),        # extra '5' is a 6th slot and sits where EOS belongs: 4/6
    ("48211111", False, 4 / 9),    # 4 extra chars -> 5 + 4 = 9 slots, 4 right
    ("48", True, 0.4),             # stopped early: 2/5 (the EOS slot at position 4 is empty)
    ("482", False, 0.6),           # 3/5
    ("", True, 0.0),               # EOS at position 0 is not the EOS slot at position 4: 0/5
    ("", False, 0.0),
])
def test_copy_reward_hand_worked(completion, eos, expected):
    out = copy_reward(completion, "4821", eos_found=eos)
    assert out["reward"] == pytest.approx(expected)
    assert out["exact"] == float(expected == 2.0)
    assert out["stopped"] == float(eos)


@pytest.mark.parametrize("completion, expected", [
    ("48213", 1.0),                     # the bare number
    ("  48213 \nSure, done.", 1.0),     # only the first non-empty line counts
    ("Repeat exactly: 48213", 0.5),     # right digits in a chatty line: 5/5 digits, half credit
    ("48218", 0.4),                     # 4/5 positions right: 0.5 * 0.8
    ("48213 times: 48213", 0.25),       # digits 4821348213 vs 48213: 5 of 10 positions
    ("482", 0.3),                       # 3 of max(3, 5) = 5 positions
    ("Sure!", 0.0),
    ("", 0.0),
])
def test_repeat_reward_hand_worked(completion, expected):
    out = repeat_reward(completion, "48213")
    assert out["reward"] == pytest.approx(expected)
    assert out["exact"] == float(expected == 1.0)


@pytest.mark.parametrize("completion, expected", [
    ("48213", 1.0),                     # the bare number
    ("  48213 \nSure, done.", 1.0),     # only the first non-empty line counts
    ("48218", 0.8),                     # 4/5 positions right
    ("4821", 0.8),                      # 4 of max(4, 5)
    ("482130", 5 / 6),                  # an extra character costs a position
    ("Repeat exactly: 48213", 0.0),     # the echo: no position matches
    ("Sure!", 0.0),
    ("", 0.0),
])
def test_repeat_chars_reward_hand_worked(completion, expected):
    out = repeat_chars_reward(completion, "48213")
    assert out["reward"] == pytest.approx(expected)
    assert out["exact"] == float(expected == 1.0)


@given(st.text(alphabet="0123456789", min_size=4, max_size=8).filter(lambda r: r[0] != "0"),
       st.text(alphabet="0123456789 abcxyz\n", max_size=12))
@settings(max_examples=200, deadline=None)
def test_the_echo_scores_below_every_answer_that_starts_with_the_number(ref, tail):
    """The trap of `repeat_reward` (the echoed instruction earns 0.5, more than a near-miss) is gone: under
    `repeat_chars_reward` the echo scores below every answer that starts with the number."""
    echo = repeat_chars_reward(f"Repeat exactly: {ref}", ref)["reward"]
    assert echo < repeat_chars_reward(ref + tail, ref)["reward"]
    # and the trap is real under the old reward: the echo beats a one-digit miss
    miss = ref[:-1] + str((int(ref[-1]) + 1) % 10)
    assert repeat_reward(f"Repeat exactly: {ref}", ref)["reward"] > repeat_reward(miss, ref)["reward"]


@pytest.mark.parametrize("completion, expected", [
    ("432", 1.0), ("47 + 385 = 432.", 1.0), ("The answer is 432.\nDone", 1.0), ("  432  ", 1.0),
    ("433", 0.0), ("432 or 431", 0.0), ("4 3 2", 0.0), ("", 0.0), ("\n\n", 0.0), ("4320", 0.0),
])
def test_answer_number_reward_reads_the_last_number_of_the_first_line(completion, expected):
    out = answer_number_reward(completion, "432")
    assert out["reward"] == out["exact"] == expected


def test_copy_reward_bonus_and_reference_types():
    assert copy_reward("46", "46", eos_found=True, bonus=0.5)["reward"] == pytest.approx(1.5)
    assert copy_reward("46", 46, eos_found=True)["reward"] == pytest.approx(2.0)  # int reference is compared as str
    # An empty reference has only the EOS slot: stopping at once is exact.
    assert copy_reward("", "", eos_found=True)["reward"] == pytest.approx(2.0)


@settings(max_examples=200, deadline=None)
@given(hyp=st.text("0123", max_size=7), ref=st.text("0123", max_size=6), eos=st.booleans(),
       pad=st.text("0123", min_size=1, max_size=3))
def test_copy_reward_range_and_padding_never_pays(hyp, ref, eos, pad):
    r = copy_reward(hyp, ref, eos_found=eos)["reward"]
    assert 0.0 <= r <= 2.0
    assert (r == 2.0) == (hyp == ref and eos)
    if len(hyp) >= len(ref):  # past the reference, every extra character only adds a wrong slot
        assert copy_reward(hyp + pad, ref, eos_found=eos)["reward"] < r or r == 0.0


def test_exact_match():
    assert exact_match("46", "46", eos_found=True) == 1.0
    assert exact_match("46", "46", eos_found=False) == 0.0           # no stop, no credit
    assert exact_match("46", "46", eos_found=False, require_eos=False) == 1.0
    assert exact_match(" 46 ", "46", eos_found=True) == 0.0
    assert exact_match(" 46 ", "46", eos_found=True, strip=True) == 1.0


@pytest.mark.parametrize("hyp, ref, dist", [
    ("abed", "abcd", 1),           # one substitution
    ("kitten", "sitting", 3),      # k->s, e->i, +g
    ("", "abc", 3), ("abc", "", 3), ("", "", 0),
    ("abcd", "abcd", 0),
    ("acbd", "abcd", 2),           # a transposition is two edits in Levenshtein
    ("谢谢同学们", "谢谢所有的同学们", 3),  # three deletions
])
def test_edit_distance_hand_worked(hyp, ref, dist):
    assert compute_edit_distance(hyp, ref) == dist
    assert compute_edit_distance(ref, hyp) == dist


def _naive_distance(a, b):
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
    return d[-1][-1]


@settings(max_examples=300, deadline=None)
@given(a=st.text("abc", max_size=9), b=st.text("abc", max_size=9))
def test_edit_distance_matches_full_table(a, b):
    # The prefix/suffix trimming and the swapped short row must not change the answer.
    assert compute_edit_distance(a, b) == _naive_distance(a, b)


def test_cer_hand_worked():
    assert compute_cer("abed", "abcd") == pytest.approx(0.25)  # 1 edit / 4 reference chars
    assert compute_cer("abcdxyz", "abcd") == pytest.approx(0.75)  # 3 insertions / 4
    assert compute_cer("", "abcd") == 1.0
    assert compute_cer("ab", "") == 2.0  # empty reference: one error per character


@pytest.mark.parametrize("text, expected", [
    ("abcxyzxyzxyz", (3, 3)),
    ("aaaa", (1, 4)),
    ("abab", (2, 2)),      # period 1 'b' covers 1 char only; 'ab' x2 covers 4
    ("abc", (0, 0)),       # no repeated tail
    ("", (0, 0)),
])
def test_tail_repeats(text, expected):
    assert compute_tail_repeats(text) == expected


def test_cer_reward_accuracy_and_hotwords():
    ref = "谢谢我们三位课代表金一南老师讲过"  # 16 chars
    perfect = cer_reward(ref, ref, hotwords=["金一南", "课代表", "同学们"])
    # CER 0 -> accuracy 1; hotwords in the reference: 金一南, 课代表 (同学们 is not); both written -> rate 2/2
    assert perfect["accuracy"] == 1.0 and perfect["hotword"] == pytest.approx(0.2)
    assert perfect["reward"] == pytest.approx(1.2) and perfect["halluc"] == 0.0
    hyp = ref.replace("金一南", "金一男")  # 1 substitution / 16 -> CER 0.0625, one of two hotwords lost
    out = cer_reward(hyp, ref, hotwords=["金一南", "课代表"])
    assert out["cer"] == pytest.approx(1 / 16)
    assert out["hotword"] == pytest.approx(0.2 * 1 / 2)
    assert out["reward"] == pytest.approx(1 - 1 / 16 + 0.1)
    count = cer_reward(ref, ref, hotwords=["金一南", "课代表"], hotword_mode="count", hotword_bonus=0.3)
    assert count["hotword"] == pytest.approx(0.6)
    # Per-row hotwords from the prompt's JSONL fields join the configured ones.
    row = cer_reward(ref, ref, meta={"fields": {"hw": ["老师"]}}, hotwords_field="hw")
    assert row["hotword"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="hotword_mode"):
        cer_reward("a", "a", hotword_mode="sum")


def test_cer_reward_normalisation():
    assert cer_reward("Hello  World", "hello world", lowercase=True, remove_whitespace=True)["cer"] == 0.0
    assert cer_reward("Hello  World", "hello world")["cer"] == pytest.approx(3 / 11)  # H, W, one extra space


def test_cer_reward_runaway_outlier_and_floor():
    """seeds/002 §5: a completion looping to the token limit scores ~-200 and squeezes the group's advantages."""
    ref = "谢谢所有的同学们"                                     # 8 chars
    loop = "谢谢" * 800                                            # 1600 chars, hit the limit without EOS
    raw = cer_reward(loop, ref, finish_reason="length", eos_found=False)
    # distance: keep 谢谢 (2 matches), substitute 6, insert 1592 -> 1598 edits / 8 = CER 199.75
    assert raw["cer"] == pytest.approx(199.75)
    assert raw["halluc"] == -2.0                                   # truncated (-1) and looping tail (-1)
    assert raw["loop_repeats"] == 1600                             # period 1: '谢' x 1600
    assert raw["reward"] == pytest.approx(1 - 199.75 - 2)

    perfect = cer_reward(ref, ref)["reward"]                        # 1.0
    three_wrong = cer_reward("谢谢所有地童鞋们", ref)["reward"]      # 3 substitutions / 8 -> 0.625
    assert three_wrong == pytest.approx(0.625)
    group = [perfect, three_wrong] * 3 + [perfect, raw["reward"]]
    adv, _ = compute_group_advantages(torch.tensor([group], dtype=torch.float64))
    # One outlier in 8: it gets -7/sqrt(8) = -2.475 and the other 7 sit near +1/sqrt(8) = +0.354, whatever
    # their quality (perfect vs 3 wrong characters differ by < 0.01).
    assert adv[0, -1].item() == pytest.approx(-7 / math.sqrt(8), abs=1e-3)
    assert abs(adv[0, 0] - adv[0, 1]).item() < 0.01

    floored = cer_reward(loop, ref, finish_reason="length", eos_found=False, floor=0.0)
    assert floored["accuracy"] == 0.0 and floored["reward"] == pytest.approx(-2.0)
    group[-1] = floored["reward"]
    adv, _ = compute_group_advantages(torch.tensor([group], dtype=torch.float64))
    assert abs(adv[0, 0] - adv[0, 1]).item() > 0.3                  # quality differences are visible again


def test_cer_reward_penalties_separately():
    ref = "abc"
    # Hit the limit without EOS but no loop: only the length penalty.
    assert cer_reward("abcdefghij", ref, finish_reason="length", eos_found=False)["halluc"] == -1.0
    # Stopped, but the tail is 'ab' x 8: only the loop penalty.
    assert cer_reward("ab" * 8, ref, finish_reason="stop", eos_found=True)["halluc"] == -1.0
    # 7 repeats is under the default threshold of 8.
    assert cer_reward("ab" * 7, ref, finish_reason="stop", eos_found=True)["halluc"] == 0.0
    assert cer_reward("ab" * 8, ref, loop_penalty=0.5, loop_min_repeats=4)["halluc"] == -0.5
