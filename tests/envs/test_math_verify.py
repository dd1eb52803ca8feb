"""math_verify_reward (final answer by \\boxed{}, ####, "answer is", last number; checked with math-verify; a
completion cut at max_new_tokens scores 0), row fields reaching rewards as keyword arguments (TRL's way), and a
reward per data_source (verl's way), in the killable reward process."""
import pickle

import pytest

from gspo_ray.data.records import Prompt, Sample
from gspo_ray.envs.plugins import PluginError
from gspo_ray.envs.reward_calls import RoutedReward, build_call_kwargs
from gspo_ray.envs import rewards
from gspo_ray.envs.rewards import (extract_final_answer, math_reference_problem, math_verify_reward,
                                  parse_math_reference)
from gspo_ray.models.tiny import build_tokenizer
from gspo_ray.rollout.scoring import RewardRunner

# (completion, reference, extracted final answer, reward)
TABLE = [
    ("She has 3 + 4 = 7, so \\boxed{7}.", "7", "7", 1.0),                         # boxed
    ("\\boxed{7} ... no wait, \\boxed{8}", "8", "8", 1.0),                         # the last box counts
    ("\\boxed{\\frac{3}{4}}", "0.75", "\\frac{3}{4}", 1.0),                         # LaTeX fraction = decimal
    ("\\boxed{{1}+{2}}", "3", "{1}+{2}", 1.0),                                      # nested braces balanced
    ("12 + 6 = 18 eggs\n#### 18", "18", "18", 1.0),                                 # GSM8K marker
    ("#### 1,200 dollars", "1200", "1,200", 1.0),                                   # thousands comma, a unit
    ("#### \\frac{1}{2}", "0.5", "\\frac{1}{2}", 1.0),                                # LaTeX after the marker
    ("2 bags of 9 is 18 apples.", "18", "18", 1.0),                                 # the trailing number
    ("Half of 3 is 3/2", "1.5", "3/2", 1.0),                                        # a fraction a/b
    ("she loses 5, so -5", "-5", "-5", 1.0),                                        # a sign
    ("Natalia sold 48 + 24 = 72 clips", "#### 72", "72", 1.0),                      # a GSM8K-style reference
    ("6/8", "\\frac{3}{4}", "6/8", 1.0),
    ("The answer is 7 apples, not 8", "7", "7", 1.0),                               # the stated answer wins
    ("3 + 4 = 7. Final answer: $7 in all, 2 left", "7", "7", 1.0),                   # over the last number
    ("The answer is 17.", "18", "17", 0.0),                                         # wrong
    ("\\boxed{18} but 19 at the end", "19", "18", 0.0),                             # the box wins over the tail
    ("", "18", None, 0.0),                                                          # empty
    ("qwerty }{ \\boxed{", "18", None, 0.0),                                        # garbage, an open box
    ("\\boxed{}", "5", None, 0.0),                                                  # an empty box finds nothing
]


@pytest.mark.parametrize("completion,reference,extracted,reward", TABLE)
def test_math_verify_reward_table(completion, reference, extracted, reward):
    assert extract_final_answer(completion) == extracted
    out = math_verify_reward(completion, reference)
    assert out["reward"] == reward and out["exact"] == reward
    assert out["has_answer"] == float(extracted is not None)


def test_a_completion_cut_at_max_new_tokens_scores_nothing():
    """The hack a last-number rule invites: repeat a frequent answer until the cap. Cut (finish_reason "length",
    no EOS) scores 0 by default; `require_stop=False` pays it; the same text stopped by EOS is paid."""
    ramble = "1\n" * 40
    cut = math_verify_reward(ramble, "1", finish_reason="length", eos_found=False)
    assert cut == {"reward": 0.0, "exact": 0.0, "has_answer": 1.0, "stopped": 0.0}
    assert math_verify_reward(ramble, "1", finish_reason="length", eos_found=False, require_stop=False)["reward"] == 1.0
    assert math_verify_reward(ramble, "1", finish_reason="stop", eos_found=True)["reward"] == 1.0
    # an EOS sampled as the very last allowed token is a stop, though the engine says "length"
    assert math_verify_reward("The answer is 1.", "1", finish_reason="length", eos_found=True)["stopped"] == 1.0


def test_strict_format_without_the_last_number_rule():
    """last_number=False (verl's strict GSM8K scoring): only \\boxed{}, #### or "answer is" count."""
    assert extract_final_answer("2 bags of 9 is 18 apples.", last_number=False) is None
    assert math_verify_reward("2 bags of 9 is 18 apples.", "18", last_number=False)["reward"] == 0.0
    assert math_verify_reward("9 * 2 = 18\nThe answer is 18.", "18", last_number=False)["reward"] == 1.0
    assert math_verify_reward("#### 18", "18", last_number=False)["reward"] == 1.0


def test_unparsable_references_are_named():
    assert math_reference_problem("42") is None and math_reference_problem("\\frac{1}{2}") is None
    assert math_reference_problem("eighteen") == "math-verify cannot parse the reference 'eighteen'"
    assert math_reference_problem("") == "the reference is empty; math_verify_reward needs an answer to verify against"
    assert math_reference_problem(None) is not None
    assert math_verify_reward.check_reference is math_reference_problem  # what the preflight calls per row


def test_plain_numbers_skip_the_parse_and_math_verify_parses_every_such_form(monkeypatch):
    """math_reference_problem passes a plain-number final answer without math-verify (microseconds instead of
    ~1-5 ms): math-verify must parse each such form, or the short cut would pass a reference the reward cannot use."""
    forms = ["0", "-7", "007", "18", "1,200", "-1,234,567.25", "3.5", "3/4", "3 / 4", "12/5.5", "-2/3",
             "99999999999999999999999"]
    for form in forms:
        assert parse_math_reference(form), form  # math-verify's parse: a non-string value

    def no_parse(answer):
        raise AssertionError(f"parsed {answer!r}")

    monkeypatch.setattr(rewards, "_math_parse", no_parse)
    for form in forms:
        assert math_reference_problem(f"She has {form} apples.\n#### {form}") is None, form
        assert math_reference_problem(form) is None, form
    with pytest.raises(AssertionError, match="parsed"):  # not a number as written (math-verify reads a set)
        math_reference_problem("1,2345")


def test_row_fields_reach_the_reward_as_keyword_arguments():
    """TRL's way: a function that declares a column gets it, one with **kwargs gets every column; the runner's
    context and reward.kwargs win over a field of the same name; fields named like the positionals are not passed."""
    fields = {"data_source": "gsm8k", "extra_info": {"index": 3}, "bonus": 9.0, "eos_found": "row's",
              "reference": "row's", "level": 2}
    context = {"completion_ids": [1], "finish_reason": "stop", "eos_found": True, "prompt_text": "p",
               "meta": {"fields": fields}}

    def declares(completion, reference, *, data_source=None, extra_info=None, bonus=1.0):
        return 0.0

    def everything(completion, reference, **kwargs):
        return 0.0

    def old_style(completion, reference, *, eos_found, **_):
        return 0.0

    assert build_call_kwargs(declares, {"bonus": 0.5})(context) == {"data_source": "gsm8k",
                                                                     "extra_info": {"index": 3}, "bonus": 0.5}
    got = build_call_kwargs(everything, {})(context)
    assert got == {**context, "data_source": "gsm8k", "extra_info": {"index": 3}, "bonus": 9.0, "level": 2}
    assert build_call_kwargs(old_style, {})(context)["eos_found"] is True


def by_source_a(completion, reference, *, data_source=None):
    return 1.0 if data_source == "a" else -1.0


def by_source_b(completion, reference, *, extra_info=None, scale=1.0):
    return scale * extra_info["w"]


def test_a_reward_per_data_source():
    routes = {"a": f"{__name__}:by_source_a", "b": f"{__name__}:by_source_b"}
    fn = RoutedReward(routes, {"scale": 2.0})

    def call(source, **fields):
        return fn("x", "y", meta={"fields": {"data_source": source, **fields}}, eos_found=True)

    assert call("a") == 1.0 and call("b", extra_info={"w": 0.25}) == 0.5  # scale goes only where it is declared
    with pytest.raises(KeyError, match=r"data_source 'c' maps to no reward function \(mapped: a, b\)"):
        call("c")
    assert RoutedReward({**routes, "*": f"{__name__}:by_source_a"})("x", "y", meta={"fields": {}}) == -1.0
    assert pickle.loads(pickle.dumps(fn)).routes == routes  # travels as its import paths
    with pytest.raises(PluginError, match=r"rollout.reward.kwargs: no mapped reward function takes \['nope'\]"):
        RoutedReward(routes, {"nope": 1})
    with pytest.raises(PluginError, match=r"rollout.reward.fn.b: no module named 'nowhere'"):
        RoutedReward({"b": "nowhere:fn"})


def test_math_verify_and_routing_in_the_killable_reward_process():
    """The runner's default isolation: calls run in child processes under the reward timeout, a routed reward
    included (the child re-imports the routes); the row's data_source picks the function."""
    tok = build_tokenizer()
    prompts = {u: Prompt(uid=u, prompt_ids=[1], reference=ref, text="q", meta={"fields": {"data_source": src}})
               for u, ref, src in (("m", "18", "math"), ("c", "12", "copy"))}

    def sample(uid, text, idx=0):
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        return Sample(prompt_uid=uid, sample_index=idx, prompt_ids=[1], completion_ids=ids, logprobs=[0.0] * len(ids),
                      loss_mask=[1] * len(ids), versions=[0] * len(ids), finish_reason="stop")

    samples = [sample("m", "3*6=18"), sample("m", "3*6=17", 1), sample("c", "12", 0), sample("c", "1", 1)]
    routes = {"math": "gspo_ray.envs.rewards:math_verify_reward", "copy": "gspo_ray.envs.rewards:copy_reward"}
    with RewardRunner(routes, tok, timeout_s=30.0, num_procs=1) as runner:
        runner.score(samples, prompts)
    assert [s.failed for s in samples] == [None] * 4
    # copy_reward, "1"+EOS against "12": 1 of 3 slots (two characters and the end) -> 1/3
    assert [s.reward for s in samples] == pytest.approx([1.0, 0.0, 2.0, 1 / 3])
