"""Reward functions, and the protocol every reward plug-in follows.

Select one in the job YAML by import path (any importable module works, not only this one):

    reward:
      fn: gspo_ray.envs.rewards:cer_reward
      kwargs: {hotwords: ["金一南"], floor: -1.0}

Protocol
--------
    fn(completion: str, reference, *, completion_ids: list[int], finish_reason: str, eos_found: bool,
       prompt_text: str | None, meta: dict, **kwargs) -> float | dict

- `completion` is the completion decoded **up to (not including) the first end-of-sequence token**, with special
  tokens kept (a pad or other special token before EOS shows up in the text and is scored as wrong). Cutting at
  EOS and reporting `eos_found` lets the reward score stopping: a model that is not paid for stopping never
  stops, and one scored on text with special tokens dropped learns to pad instead of stopping.
- `reference` is `Prompt.reference` as given by the prompt source (a string for the built-in tasks and JSONL).
- `completion_ids`: the raw completion token ids (EOS and anything after it included).
- `finish_reason`: the engine's, "stop" | "length" | "aborted". `eos_found`: an EOS token id is in the ids.
- `prompt_text`, `meta`: `Prompt.text` and `Prompt.meta` (file rows put their other fields in `meta["fields"]`).
- `**kwargs`: the YAML's `reward.kwargs`, passed on every call, and the row's other fields (columns besides the
  prompt and the reference, nested as they are: `data_source`, `extra_info`, ...), as TRL passes dataset columns;
  context and `reward.kwargs` win over a field of the same name (`gspo_ray.envs.reward_calls`). The runner passes
  only the keyword arguments a function declares, so `def fn(completion, reference): ...` is a valid reward;
  declare `**kwargs` to get all, or a field by name with a default (`extra_info=None`).
- Return a float, or a dict `{"reward": float, "<name>": float, ...}`: the other entries are logged per sample in
  `Sample.reward_info` (e.g. `char_acc`, `exact`). A dict may also carry `"token_rewards": list[float]` with one
  entry per completion token. A non-finite reward marks the sample failed instead of poisoning its group.
- Optional: a `check_reference(reference) -> str | None` attribute on the function; the preflight calls it on every
  row's reference and reports the rows it returns a problem for (`math_verify_reward` has one).
- Functions run in worker threads (several at once): keep them free of shared mutable state. A function that
  raises or exceeds `reward.timeout_s` fails only its own sample (see `gspo_ray.rollout.scoring`).
"""
from __future__ import annotations

import functools
import re
from typing import Any, Iterable


def copy_reward(completion: str, reference: Any, *, eos_found: bool, bonus: float = 1.0,
                **_: Any) -> dict[str, float]:
    """Per-character credit over the reference plus its end position, + `bonus` for an exact, stopped answer.

    The slots are the reference's characters and one end-of-sequence slot after them. A slot is right when the
    completion has the same character there (for the end slot: the completion stopped exactly there). Extra
    characters beyond the reference add one wrong slot each, so padding never pays. Range [0, 1 + bonus].
        ref "4821":  "4821"+EOS -> 5/5 + 1 = 2.0;  "4821" no EOS -> 4/5 = 0.8;  "4831"+EOS -> 4/5 = 0.8
    Serves every task whose answer is a short exact string (copy, arithmetic).
    """
    ref = str(reference)
    hits = sum(1 for a, b in zip(completion, ref) if a == b)
    stopped_right = eos_found and len(completion) == len(ref)
    slots = len(ref) + 1 + max(0, len(completion) - len(ref))
    char_acc = (hits + int(stopped_right)) / slots
    exact = float(stopped_right and completion == ref)
    return {"reward": char_acc + bonus * exact, "char_acc": char_acc, "exact": exact, "stopped": float(eos_found)}


def repeat_chars_reward(completion: str, reference: Any, **_: Any) -> dict[str, float]:
    """The share of the answer's first non-empty line that matches the reference character by character, position
    by position (over the longer of the two, so extra characters cost); 1.0 only for the bare number.
        ref "48213":  "48213" -> 1.0;  "48213\nDone." -> 1.0;  "48218" -> 0.8;  "4821" -> 0.8;
                      "Repeat exactly: 48213" -> 0.0 (no position matches);  "The number is 48213" -> 0.0
    Why not `repeat_reward`: that one extracts the digits of a chatty line, so echoing the instruction earns 0.5,
    a plateau SmolLM2-135M-Instruct (which mostly echoes) sits on: inside a group of echoes the advantages are
    ~0 and the bare number must first appear by chance. Here an echo earns ~0 and every step towards the bare
    number pays.
    """
    ref = str(reference).strip()
    lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    first = lines[0] if lines else ""
    char_acc = sum(a == b for a, b in zip(first, ref)) / max(len(first), len(ref), 1)
    return {"reward": char_acc, "exact": float(first == ref), "char_acc": char_acc}


def answer_number_reward(completion: str, reference: Any, **_: Any) -> dict[str, float]:
    """1.0 when the last number on the answer's first non-empty line is the reference, else 0.0 (a verifiable
    reward for arithmetic and digit tasks: "432", "47 + 385 = 432" and "The answer is 432." all count; "1 2 5 9"
    reads as 9). Digits separated by commas or spaces are separate numbers.
        ref "432":  "432" -> 1.0;  "47 + 385 = 432." -> 1.0;  "433" -> 0.0;  "432 or 431" -> 0.0;  "" -> 0.0
    """

    lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    numbers = re.findall(r"\d+", lines[0]) if lines else []
    exact = float(bool(numbers) and numbers[-1] == str(reference).strip())
    return {"reward": exact, "exact": exact}


def repeat_reward(completion: str, reference: Any, **_: Any) -> dict[str, float]:
    """1.0 when the completion's first non-empty line is exactly the reference; else 0.5 x the share of positions
    where the digits of that line match the reference's (over the longer of the two, so extra digits cost).
        ref "48213":  "48213" -> 1.0;  "48213\nDone." -> 1.0;  "Repeat exactly: 48213" -> 0.5;  "48218" -> 0.4;
                      "48213 times: 48213" -> 0.5 * 5/10 = 0.25
    For instruction-tuned models ("Repeat exactly: 48213"; SmolLM2-135M-Instruct mostly echoes the instruction):
    the right digits in a chatty line earn half, the bare number all. Kept as a lesson in reward shaping: the echo's
    0.5 is a plateau that traps GSPO's group baseline (measured: held-out exact 0.00 after 10 steps at lr 1e-5, while
    `repeat_chars_reward` reaches 1.00); the packaged recipe uses `repeat_chars_reward`.
    """
    ref = str(reference).strip()
    lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if first == ref:
        return {"reward": 1.0, "exact": 1.0, "digit_acc": 1.0}
    digits = "".join(ch for ch in first if ch.isdigit())
    digit_acc = sum(a == b for a, b in zip(digits, ref)) / max(len(digits), len(ref), 1)
    return {"reward": 0.5 * digit_acc, "exact": 0.0, "digit_acc": digit_acc}


def exact_match(completion: str, reference: Any, *, eos_found: bool = True, require_eos: bool = True,
                strip: bool = False, **_: Any) -> float:
    """1.0 when the completion equals the reference (and stopped, unless `require_eos=False`), else 0.0."""
    hyp, ref = (completion.strip(), str(reference).strip()) if strip else (completion, str(reference))
    return float(hyp == ref and (eos_found or not require_eos))


def compute_edit_distance(hyp: str, ref: str) -> int:
    """Levenshtein distance (substitutions + insertions + deletions), plain Python, O(len(hyp) * len(ref))."""
    # A shared prefix/suffix never costs an edit; trimming it makes near-correct answers (the common case) cheap.
    start = 0
    while start < len(hyp) and start < len(ref) and hyp[start] == ref[start]:
        start += 1
    end_h, end_r = len(hyp), len(ref)
    while end_h > start and end_r > start and hyp[end_h - 1] == ref[end_r - 1]:
        end_h, end_r = end_h - 1, end_r - 1
    a, b = hyp[start:end_h], ref[start:end_r]
    if len(a) < len(b):
        a, b = b, a  # keep the DP row over the shorter string
    if not b:
        return len(a)
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            # d[i][j] = min(delete, insert, substitute-or-match)
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
        prev = cur
    return prev[-1]


def compute_cer(hyp: str, ref: str) -> float:
    """Character error rate = edit distance / len(ref) (1 per character for an empty reference). Unbounded above:
    a runaway hypothesis of 2,000 characters against a 10-character reference has CER ~200."""
    return compute_edit_distance(hyp, ref) / max(1, len(ref))


def compute_tail_repeats(text: str, max_period: int = 32) -> tuple[int, int]:
    """The repeating unit that ends `text` and covers the most characters: (period, whole repeats).

    "abcxyzxyzxyz" -> (3, 3). The loop of a hallucinating model ("谢谢谢谢…", "the the the …") shows up as a
    tail made of many copies of one short unit. (0, 0) for empty text.
    """
    best_period, best_repeats, best_cover = 0, 0, 0
    for period in range(1, min(max_period, len(text)) + 1):
        unit = text[len(text) - period:]
        repeats, pos = 1, len(text) - 2 * period
        while pos >= 0 and text[pos:pos + period] == unit:
            repeats, pos = repeats + 1, pos - period
        if repeats > 1 and repeats * period > best_cover:
            best_period, best_repeats, best_cover = period, repeats, repeats * period
    return best_period, best_repeats


def _count_hotwords(hyp: str, ref: str, hotwords: Iterable[str]) -> tuple[int, int]:
    """(hotwords in the reference that the hypothesis also contains, hotwords in the reference)."""
    wanted = [w for w in dict.fromkeys(hotwords) if w and w in ref]
    return sum(1 for w in wanted if w in hyp), len(wanted)


def _normalise(text: str, lowercase: bool, remove_whitespace: bool) -> str:
    text = text.lower() if lowercase else text
    return "".join(text.split()) if remove_whitespace else text


def cer_reward(completion: str, reference: Any, *, finish_reason: str = "stop", eos_found: bool = True,
               meta: dict | None = None, hotwords: Iterable[str] = (), hotwords_field: str | None = None,
               hotword_bonus: float = 0.2, hotword_mode: str = "rate", length_penalty: float = 1.0,
               loop_penalty: float = 1.0, loop_min_repeats: int = 8, loop_max_period: int = 32,
               floor: float | None = None, lowercase: bool = False, remove_whitespace: bool = False,
               **_: Any) -> dict[str, float]:
    """Text reward = accuracy + hotword bonus - hallucination penalty (the three-part ASR reward).

    accuracy  1 - CER (Levenshtein over characters / reference length). It has no lower bound: one completion
              that loops to the token limit can score -200 and, in a group of 8, squeeze the other 7 advantages
              to ~+0.354 whatever their quality. `floor` (e.g. -1.0 or 0.0) clips it from below.
    hotword   for the hotwords that occur in the reference (`hotwords`, plus the list in the prompt row's
              `meta["fields"][hotwords_field]`): "count" mode pays `hotword_bonus` per one also in the completion;
              "rate" mode pays `hotword_bonus * found / present` (0 when the reference has none).
    halluc    -`length_penalty` when the completion hit the token limit without EOS, and -`loop_penalty` when
              its tail is one unit of <= `loop_max_period` characters repeated >= `loop_min_repeats` times.
    Usable on any text task; the scores of each part are returned as named components.
    """
    if hotword_mode not in ("count", "rate"):
        raise ValueError(f"cer_reward: hotword_mode must be 'count' or 'rate', got {hotword_mode!r}")
    hyp = _normalise(completion, lowercase, remove_whitespace)
    ref = _normalise(str(reference), lowercase, remove_whitespace)
    cer = compute_cer(hyp, ref)
    accuracy = 1.0 - cer if floor is None else max(1.0 - cer, floor)

    words = list(hotwords)
    if hotwords_field and meta:
        words += list(meta.get("fields", {}).get(hotwords_field) or [])
    words = [_normalise(w, lowercase, remove_whitespace) for w in words]
    found, present = _count_hotwords(hyp, ref, words)
    if hotword_mode == "count":
        hotword = hotword_bonus * found
    else:
        hotword = hotword_bonus * found / present if present else 0.0

    truncated = finish_reason == "length" and not eos_found
    _, repeats = compute_tail_repeats(hyp, loop_max_period)
    looping = repeats >= loop_min_repeats
    halluc = -(length_penalty * truncated + loop_penalty * looping)
    return {"reward": accuracy + hotword + halluc, "cer": cer, "accuracy": accuracy, "hotword": hotword,
            "halluc": halluc, "truncated": float(truncated), "loop_repeats": float(repeats)}


# ---- math answers, verified with math-verify ---------------------------------------------------------------------
# A number as written in an answer: an integer or decimal (thousands commas allowed), optionally a fraction a/b.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?")
_GSM8K_MARK = "####"
# "The answer is 18", "final answer: $18", "answer = 18": the number right after the phrase.
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*\$?\s*(" + _NUMBER.pattern + ")", re.IGNORECASE)


def _last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None when there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[begin:i - 1] if depth == 0 else None


def extract_final_answer(text: str, *, last_number: bool = True) -> str | None:
    """The final answer of a completion, by the first rule that finds one:
    1. the content of the last `\\boxed{...}` (LaTeX; `\\fbox{...}` too), braces balanced;
    2. the rest of the line after the last `####` (GSM8K's answer marker): the number it starts with, if any;
    3. the number after the last "answer is" / "answer:" (any case; "The answer is N." is what prompts ask for);
    4. the last number in the text (integer, decimal, thousands commas, or a fraction a/b), unless `last_number`
       is False (verl's "strict" GSM8K scoring: an answer not in a stated format is no answer).
    None when no rule finds anything non-empty.
        "so \\boxed{\\frac{3}{4}}." -> "\\frac{3}{4}";  "#### 1,200 dollars" -> "1,200";
        "The answer is 7 apples, not 8" -> "7";  "3 + 4 = 7 apples" -> "7" (None without `last_number`)
    """
    boxed = _last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    if _GSM8K_MARK in text:
        after = text.rsplit(_GSM8K_MARK, 1)[1].strip().splitlines()
        rest = after[0].strip() if after else ""
        number = _NUMBER.match(rest.lstrip("$"))
        if rest:
            return number.group().replace(" ", "") if number else rest
    stated = _ANSWER_IS.findall(text)
    if stated:
        return stated[-1].replace(" ", "")
    numbers = _NUMBER.findall(text) if last_number else []
    return numbers[-1].replace(" ", "") if numbers else None


def _math_parse(answer: str) -> list:
    """math-verify's parse of one answer as LaTeX or a plain expression ([] when it finds nothing). No timeout of
    its own (its signal alarm works only on a main thread): the reward process's timeout bounds the call."""
    import math_verify.grader
    import math_verify.parser
    from math_verify import parse

    # The warning that parse/verify run without their own timeout is shown once per process; ours is the
    # reward runner's (a process killed at rollout.reward.timeout_s).
    math_verify.parser.TIMEOUT_WARNING_SHOWN = math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    return parse(f"${answer.strip().strip('$')}$", parsing_timeout=None)


def _reference_answer(reference: str) -> str:
    """The part of a reference math-verify parses: a reference with a `\\boxed{}` or a `####` marker (a GSM8K
    solution) is reduced to its final answer (`extract_final_answer` rules 1 and 2), else it is taken whole."""
    text = reference.strip()
    if _last_boxed(text) is not None or _GSM8K_MARK in text:
        text = extract_final_answer(text) or ""
    return text


@functools.lru_cache(maxsize=4096)
def parse_math_reference(reference: str) -> tuple:
    """The reference parsed by math-verify, () when it cannot be (math-verify then gives back only the string).
    A reference with a `\\boxed{}` or a `####` marker (a GSM8K solution) is reduced to its final answer first."""
    text = _reference_answer(reference)
    parsed = tuple(_math_parse(text)) if text else ()
    return parsed if any(not isinstance(x, str) for x in parsed) else ()


def math_reference_problem(reference: Any) -> str | None:
    """Why math-verify cannot use this reference (None when it can): the preflight's check of every row.
    A final answer that is a plain number (`_NUMBER`: integer, decimal, thousands commas, a fraction a/b) needs no
    parse: math-verify parses every such number (tests/envs/test_math_verify.py checks the forms), and the parse
    costs ~1-5 ms where the match costs microseconds (100k GSM8K rows: docs/benchmarks.md)."""
    if reference is None or not str(reference).strip():
        return "the reference is empty; math_verify_reward needs an answer to verify against"
    if _NUMBER.fullmatch(_reference_answer(str(reference))):
        return None
    if not parse_math_reference(str(reference)):
        return f"math-verify cannot parse the reference {str(reference)[:60]!r}"
    return None


def math_verify_reward(completion: str, reference: Any, *, finish_reason: str = "stop", eos_found: bool = True,
                       require_stop: bool = True, last_number: bool = True, **_: Any) -> dict[str, float]:
    """1.0 when the completion stopped and its final answer equals the reference mathematically (math-verify:
    0.75 = 3/4 = \\frac{6}{8}), else 0.0. The final answer is found by `extract_final_answer`: the last `\\boxed{}`,
    else what follows the last `####`, else the number after the last "answer is", else (`last_number`) the last
    number. `has_answer` says whether one was found at all; `stopped` whether the completion ended by itself.
        ref "18":  "... \\boxed{18}" -> 1.0;  "#### 18" -> 1.0;  "so she has 18 eggs." -> 1.0;  "17" -> 0.0;  "" -> 0.0
    `require_stop` (the default): a completion cut at max_new_tokens (finish_reason "length", no EOS) scores 0
    whatever it holds. Without it, the last-number rule pays a cut ramble for any number it happens to end on, and
    a policy learns to repeat a frequent answer until the cap: "1\\n1\\n1..." scored 12.5% of a held-out set whose
    answer is 1 in 8 of 64 problems (docs/data.md).
    Run it under `rollout.reward.isolation: process` (the default): math-verify's sympy can take long on odd input,
    and only a process is stopped at `rollout.reward.timeout_s`. The preflight checks that every reference parses.
    """
    from math_verify import verify

    stopped = not (finish_reason == "length" and not eos_found)
    gold = parse_math_reference(str(reference))
    answer = extract_final_answer(completion, last_number=last_number)
    info = {"has_answer": float(answer is not None), "stopped": float(stopped)}
    if not gold or answer is None or (require_stop and not stopped):
        return {"reward": 0.0, "exact": 0.0, **info}
    target = _math_parse(answer)
    ok = bool(target) and verify(list(gold), target, timeout_seconds=None)
    return {"reward": float(ok), "exact": float(ok), **info}


# The preflight calls this on every row's reference before training starts (gspo_ray/preflight/data.py).
math_verify_reward.check_reference = math_reference_problem
