"""Multi-turn environments without an engine: scripted actions through the guessing game and the calculator,
exact token transcripts, and every kind of malformed env output rejected before it could reach an engine."""
from __future__ import annotations

import math

import pytest

from gspo_ray.config import MultiTurnConfig, RolloutConfig
from gspo_ray.data.records import Prompt
from gspo_ray.envs.calculator import CalculatorEnv, compute_expression
from gspo_ray.envs.guess import GuessNumberEnv, build_guess_prompts, parse_guess
from gspo_ray.envs.multiturn import (EnvError, MultiTurnEnv, StepResult, check_env, check_observation,
                                     check_step_result, decode_action, encode_text, numeric_info)
from gspo_ray.models.tiny import build_tokenizer
from gspo_ray.envs.plugins import PluginError

EOS = 1


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _act(tok, text: str, eos: bool = True) -> tuple[list[int], str]:
    """What the runner hands to `step`: the action's ids (with EOS if the model stopped) and its text."""
    ids = encode_text(tok, text) + ([EOS] if eos else [])
    shown, found = decode_action(tok, ids, frozenset([EOS]))
    assert found == eos and shown == text
    return ids, shown


def _decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_guess_binary_search_transcript(tok):
    env = GuessNumberEnv(tok, low=0, high=99)
    prompt = build_guess_prompts(tok, 1, low=0, high=99)[0]
    prompt.reference = 37
    assert prompt.text == "0-99:" and _decode(tok, prompt.prompt_ids) == "0-99:"
    ids = list(prompt.prompt_ids) + env.reset(prompt, seed=0)
    script = [("50", "-", 0.0, False), ("25", "+", 0.0, False), ("37", "=", 1.0, True)]
    for guess, hint, reward, done in script:
        action, text = _act(tok, guess)
        r = env.step(action, text)
        assert (r.reward, r.done) == (reward, done)
        ids += action + check_observation(r.observation, tok, len(tok), "step")
    # the token transcript reads exactly as the game went
    assert _decode(tok, ids) == "0-99:50<eos>-25<eos>+37<eos>="
    assert r.info["solved"] == 1.0 and r.info["guesses"] == 3


@pytest.mark.parametrize("text,eos,why", [("5", False, "no EOS"), ("5+", True, "not digits"),
                                          ("100", True, "out of range"), ("", True, "empty"),
                                          ("c", True, "letter")])
def test_guess_invalid_actions_get_star(tok, text, eos, why):
    env = GuessNumberEnv(tok, low=0, high=99, invalid_reward=-0.5)
    env.reset(Prompt("p", [6], reference=7), seed=0)
    r = env.step(*_act(tok, text, eos))
    assert _decode(tok, r.observation) == "*" and r.reward == -0.5 and not r.done, why
    assert parse_guess(text, eos, 0, 99) is None


def test_guess_secret_from_seed_is_per_seed(tok):
    env = GuessNumberEnv(tok, low=0, high=99)
    no_ref = Prompt("p", [6])
    secrets = set()
    for seed in range(20):
        env.reset(no_ref, seed)
        first = env.secret
        env.reset(no_ref, seed)
        assert env.secret == first  # same seed, same secret: a group faces one task
        secrets.add(first)
    assert len(secrets) > 5
    with pytest.raises(ValueError, match="outside"):
        env.reset(Prompt("p", [6], reference=120), 0)


def test_guess_prompts_are_seeded(tok):
    a, b = build_guess_prompts(tok, 8, seed=3), build_guess_prompts(tok, 8, seed=3)
    assert [p.reference for p in a] == [p.reference for p in b]
    assert len({p.uid for p in a}) == 8 and all(0 <= p.reference <= 9 for p in a)


@pytest.mark.parametrize("expr,value", [("12+34", 46), ("2+3*4", 14), ("2*3+4", 10), ("5-9", -4),
                                        ("-3*3", -9), ("10-2-3", 5), ("7", 7), ("1*2*3*4", 24),
                                        ("999999*999999", 999998000001), ("999999*999999*9", None),  # >= 1e12
                                        ("1234567", None), ("", None), ("1++2", None), ("+1", None),
                                        ("3*", None), ("c1", None)])
def test_compute_expression(expr, value):
    assert compute_expression(expr) == value


def test_calculator_tool_call_then_answer(tok):
    env = CalculatorEnv(tok, call_reward=0.1)
    prompt = Prompt("q", encode_text(tok, "12+34="), reference="46", text="12+34=")
    ids = list(prompt.prompt_ids) + env.reset(prompt, seed=0)
    action = _act(tok, "c12+34")
    r = env.step(*action)
    assert (r.reward, r.done) == (0.1, False)
    ids += action[0] + r.observation
    action = _act(tok, "46")
    r = env.step(*action)
    assert (r.reward, r.done, r.info["correct"], r.info["calls"]) == (1.0, True, 1.0, 1)
    ids += action[0] + check_observation(r.observation, tok, len(tok), "step")
    assert _decode(tok, ids) == "12+34=c12+34<eos>=46" + "46<eos>"


@pytest.mark.parametrize("answer,eos,reward", [("46", True, 1.0), ("46", False, 0.0), ("47", True, 0.0),
                                               ("046", True, 0.0), ("", True, 0.0)])
def test_calculator_direct_answer(tok, answer, eos, reward):
    env = CalculatorEnv(tok)
    assert env.reset(Prompt("q", encode_text(tok, "12+34="), text="12+34="), 0) == []  # answer from the text
    r = env.step(*_act(tok, answer, eos))
    assert (r.reward, r.done, r.observation) == (reward, True, "")


def test_calculator_bad_calls_and_call_limit(tok):
    env = CalculatorEnv(tok, max_calls=2, call_reward=0.5)
    env.reset(Prompt("q", [6], reference="5"), 0)
    r = env.step(*_act(tok, "c2+", True))  # malformed expression
    assert _decode(tok, r.observation) == "*" and r.reward == 0.0 and not r.done
    r = env.step(*_act(tok, "c2+3", False))  # no EOS: the call never closed
    assert _decode(tok, r.observation) == "*" and not r.done
    r = env.step(*_act(tok, "c2+3"))  # third call, limit 2: the episode ends unanswered
    assert (r.reward, r.done, r.info["calls_exceeded"]) == (0.0, True, 1.0)


def test_envs_follow_the_protocol():
    assert issubclass(GuessNumberEnv, MultiTurnEnv) and issubclass(CalculatorEnv, MultiTurnEnv)
    assert check_env(MultiTurnConfig().env) is GuessNumberEnv
    assert check_env("gspo_ray.envs.calculator:CalculatorEnv") is CalculatorEnv
    assert RolloutConfig(multi_turn={"env": "gspo_ray.envs.calculator:CalculatorEnv"}).multi_turn.max_turns == 4


@pytest.mark.parametrize("path,match", [("gspo_ray.envs.guess:Nope", "has no attribute 'Nope'"),
                                        ("gspo_ray.envs.calculator:compute_expression", "expected a class"),
                                        ("gspo_ray.envs.multiturn:StepResult", r"no method\(s\) \['reset', 'step'\]")])
def test_check_env_names_the_field(path, match):
    with pytest.raises(PluginError, match=match) as e:
        check_env(path)
    assert str(e.value).startswith("rollout.multi_turn.env:")


@pytest.mark.parametrize("result,match", [
    (("+", 1.0, False, {}), "expected a StepResult"),                      # a tuple is not the record
    (StepResult("+", math.nan), "malformed reward nan"),
    (StepResult("+", math.inf), "malformed reward inf"),
    (StepResult("+", "1.0"), "malformed reward str"),
    (StepResult("+", True), "malformed reward True"),
    (StepResult([3, 99]), r"malformed token ids \[99\]"),                  # outside the 22-token vocabulary
    (StepResult([3, -1]), r"malformed token ids \[-1\]"),
    (StepResult([3, 4.0]), r"malformed token ids \[4.0\]"),
    (StepResult(None), "NoneType observation"),
    (StepResult("x<>"), "does not survive the tokenizer"),                 # characters outside the alphabet
    (StepResult("+", 0.0, 1), "done=1"),
    (StepResult("+", 0.0, False, []), "info of type list"),
])
def test_malformed_step_results_are_rejected(tok, result, match):
    with pytest.raises(EnvError, match=match):
        check_step_result(result, tok, len(tok))


def test_well_formed_step_results_pass(tok):
    assert check_step_result(StepResult("=46", 1, True, {"k": 2}), tok, len(tok)) == (
        encode_text(tok, "=46"), 1.0, True, {"k": 2})
    assert check_step_result(StepResult((3, 4)), tok, len(tok))[0] == [3, 4]
    assert numeric_info({"a": 1, "b": "x", "c": math.nan, "d": True}) == {"env/a": 1.0, "env/d": 1.0}
