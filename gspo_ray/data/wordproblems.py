"""A generated multi-step word-problem task (GSM8K-like): 2-3 operations over small quantities with a unit and an
integer answer; the prompt asks for reasoning, then the answer in a stated form.

    gspo-ray data make wordproblems --out runs/data/wordproblems            # the files below
    train, held_out = build_wordproblem_splits(num_train=4000, num_eval=64, seed=0)
    train[0].question, train[0].answer, train[0].solution                  # "Mia has 4 apples. ...", 22, "4 + 3 * 6 = 22"

`write_wordproblems(out)` writes the task in both layouts users bring (docs/data.md):
    out/train.parquet, out/test.parquet   verl: prompt (chat messages), reward_model.ground_truth, data_source,
                                          ability, extra_info (split, index, question, solution, ops)
    out/trl/train, out/trl/test           TRL: `datasets` save_to_disk directories with prompt (chat messages),
                                          solution (the answer) and ops
The held-out problems are drawn first from their own seed stream and training skips their texts, so the splits are
disjoint and the held-out set does not change with num_train. Deterministic in the seed.
"""
from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DATA_SOURCE = "gspo_ray/wordproblems"
# What the prompt asks for after the question. "reason" (the default) lets a small model ramble: SmolLM2-135M's
# completions fill most of 128 tokens; "oneline" asks for the arithmetic alone and roughly halves them (docs/data.md).
INSTRUCTIONS = {
    "reason": "Reason step by step, then finish with a last line of the form \"The answer is N.\" with N a number.",
    "oneline": "Write the calculation as one line of arithmetic, then a last line of the form \"The answer is N.\"",
}
INSTRUCTION = INSTRUCTIONS["reason"]
NAMES = ("Mia", "Noah", "Ava", "Liam", "Zoe", "Omar", "Lena", "Ravi", "Sara", "Tom", "Yuki", "Ines")
ITEMS = ("apples", "marbles", "stickers", "cookies", "pencils", "shells", "stamps", "books", "eggs", "cards")
_MAX_DRAWS = 50  # draws per wanted problem before the space counts as exhausted
# The most of a split one answer value may take. Uncapped, small answers pile up (_share's "each - eaten" is often
# 1): "1" was 12.5% of the held-out set and a policy learned to print it (docs/data.md). At 4% a constant guess
# scores at most ceil(0.04 * n) / n of a split (3 of 64 held-out problems).
MAX_ANSWER_SHARE = 0.04


@dataclass(frozen=True)
class WordProblem:
    """One problem: its text, the integer answer, a worked line of arithmetic, how many operations it takes."""

    question: str
    answer: int
    solution: str
    ops: int

    @property
    def prompt(self) -> str:
        return self.prompt_with("reason")

    def prompt_with(self, instruction: str) -> str:
        """The question followed by one of INSTRUCTIONS (by name)."""
        if instruction not in INSTRUCTIONS:
            raise ValueError(f"instruction {instruction!r} unknown; valid: {', '.join(INSTRUCTIONS)}")
        return f"{self.question}\n{INSTRUCTIONS[instruction]}"


def _buy_packs(r: random.Random, hi: int) -> WordProblem:
    name, item, a, b, c = r.choice(NAMES), r.choice(ITEMS), r.randint(2, hi), r.randint(2, hi), r.randint(2, hi)
    return WordProblem(f"{name} has {a} {item}. {name} buys {b} packs of {item} with {c} {item} in each pack. How "
                       f"many {item} does {name} have now?", a + b * c, f"{a} + {b} * {c} = {a + b * c}", 2)


def _pick_and_give(r: random.Random, hi: int) -> WordProblem:
    name, item, a, b = r.choice(NAMES), r.choice(ITEMS), r.randint(2, hi), r.randint(2, hi)
    c = r.randint(1, a * b - 1)
    return WordProblem(f"{name} collects {a} {item} every day for {b} days, then gives {c} {item} to a friend. How "
                       f"many {item} does {name} have left?", a * b - c, f"{a} * {b} - {c} = {a * b - c}", 2)


def _share(r: random.Random, hi: int) -> WordProblem:
    name, item, each, friends = r.choice(NAMES), r.choice(ITEMS), r.randint(2, hi), r.randint(2, hi)
    eaten = r.randint(1, each - 1)
    total = each * friends
    return WordProblem(f"{name} shares {total} {item} equally among {friends} friends. Each friend then gives away "
                       f"{eaten} of them. How many {item} does each friend have left?", each - eaten,
                       f"{total} / {friends} - {eaten} = {each - eaten}", 2)


def _wage(r: random.Random, hi: int) -> WordProblem:
    name, rate, mon, tue = r.choice(NAMES), r.randint(2, hi), r.randint(2, hi), r.randint(2, hi)
    return WordProblem(f"{name} earns {rate} dollars an hour. {name} works {mon} hours on Monday and {tue} hours on "
                       f"Tuesday. How many dollars does {name} earn in total?", rate * (mon + tue),
                       f"{rate} * ({mon} + {tue}) = {rate * (mon + tue)}", 2)


def _packs_then_give(r: random.Random, hi: int) -> WordProblem:
    name, item, a, b, c = r.choice(NAMES), r.choice(ITEMS), r.randint(2, hi), r.randint(2, hi), r.randint(2, hi)
    d = r.randint(1, a + b * c - 1)
    ans = a + b * c - d
    return WordProblem(f"{name} has {a} {item}. {name} buys {b} bags with {c} {item} in each bag, then gives away "
                       f"{d} {item}. How many {item} does {name} have now?", ans, f"{a} + {b} * {c} - {d} = {ans}", 3)


def _shop_day(r: random.Random, hi: int) -> WordProblem:
    item, b, d, e = r.choice(ITEMS), r.randint(1, hi), r.randint(2, hi), r.randint(2, hi)
    a = b + r.randint(1, hi)
    ans = a - b + d * e
    return WordProblem(f"A shop has {a} {item}. It sells {b} of them in the morning, then gets {d} boxes with {e} "
                       f"{item} in each box. How many {item} does the shop have at the end of the day?", ans,
                       f"{a} - {b} + {d} * {e} = {ans}", 3)


def _reading(r: random.Random, hi: int) -> WordProblem:
    name, a, b, c, d = r.choice(NAMES), r.randint(2, hi), r.randint(2, hi), r.randint(2, hi), r.randint(2, hi)
    ans = a * b + c * d
    return WordProblem(f"{name} reads {a} pages on each of {b} days, then {c} pages on each of the next {d} days. "
                       f"How many pages does {name} read in all?", ans, f"{a} * {b} + {c} * {d} = {ans}", 3)


TEMPLATES: dict[int, tuple[Callable[[random.Random, int], WordProblem], ...]] = {
    2: (_buy_packs, _pick_and_give, _share, _wage), 3: (_packs_then_give, _shop_day, _reading)}


def _draw(n: int, rng: random.Random, ops: list[int], max_value: int, exclude: set[str],
          max_answer_share: float) -> list[WordProblem]:
    """n distinct problems not in `exclude`, no answer value on more than ceil(max_answer_share * n) of them."""
    out: list[WordProblem] = []
    seen, answers, cap = set(exclude), Counter(), max(1, math.ceil(max_answer_share * n))
    for _ in range(n * _MAX_DRAWS):
        if len(out) == n:
            break
        problem = rng.choice(TEMPLATES[rng.choice(ops)])(rng, max_value)
        if problem.question not in seen and answers[problem.answer] < cap:
            seen.add(problem.question)
            answers[problem.answer] += 1
            out.append(problem)
    return out


def best_constant_guess(problems: list[WordProblem]) -> tuple[int, float]:
    """The answer a policy that ignores the question would print, and the pass@1 it would score on `problems`."""
    answer, count = Counter(p.answer for p in problems).most_common(1)[0]
    return answer, count / len(problems)


def build_wordproblem_splits(num_train: int = 4000, num_eval: int = 64, seed: int = 0, min_ops: int = 2,
                             max_ops: int = 3, max_value: int = 5, max_answer_share: float = MAX_ANSWER_SHARE
                             ) -> tuple[list[WordProblem], list[WordProblem]]:
    """(train, held-out) problems, disjoint by text; each problem takes min_ops..max_ops operations (chosen
    uniformly, then a template of that many uniformly) over quantities of at most `max_value`; within a split no
    answer value covers more than `max_answer_share` of the problems (rounded up), so no constant guess pays."""
    if not 2 <= min_ops <= max_ops <= 3:
        raise ValueError(f"need 2 <= min_ops <= max_ops <= 3, got {min_ops} and {max_ops}")
    if max_value < 3 or num_train < 1 or num_eval < 1:
        raise ValueError(f"need max_value >= 3, num_train >= 1, num_eval >= 1; got {max_value}, {num_train}, "
                         f"{num_eval}")
    ops = list(range(min_ops, max_ops + 1))
    if not 0.0 < max_answer_share <= 1.0:
        raise ValueError(f"need 0 < max_answer_share <= 1, got {max_answer_share}")
    held_out = _draw(num_eval, random.Random(f"gspo_ray.wordproblems:{seed}:eval"), ops, max_value, set(),
                     max_answer_share)
    train = _draw(num_train, random.Random(f"gspo_ray.wordproblems:{seed}:train"), ops, max_value,
                  {p.question for p in held_out}, max_answer_share)
    if len(held_out) < num_eval or len(train) < num_train:
        raise ValueError(f"only {len(train)} training and {len(held_out)} held-out distinct problems with "
                         f"max_value={max_value}, no answer on more than {max_answer_share:g} of a split; raise "
                         "max_value or ask for fewer")
    return train, held_out


def verl_rows(problems: list[WordProblem], split: str, instruction: str = "reason") -> list[dict]:
    """Rows in verl's parquet layout (its examples/data_preprocess scripts write the same columns)."""
    return [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": p.prompt_with(instruction)}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
             "extra_info": {"split": split, "index": i, "question": p.question, "solution": p.solution, "ops": p.ops}}
            for i, p in enumerate(problems)]


def trl_rows(problems: list[WordProblem], instruction: str = "reason") -> list[dict]:
    """Rows of a conversational TRL dataset: `prompt` messages, the answer in `solution` (TRL's accuracy reward
    reads that column), the operation count as an extra column."""
    return [{"prompt": [{"role": "user", "content": p.prompt_with(instruction)}], "solution": str(p.answer), "ops": p.ops}
            for p in problems]


def write_wordproblems(out: str | Path, num_train: int = 4000, num_eval: int = 64, seed: int = 0, min_ops: int = 2,
                       max_ops: int = 3, max_value: int = 5, instruction: str = "reason",
                       max_answer_share: float = MAX_ANSWER_SHARE) -> dict[str, Path]:
    """Write both splits as verl parquet files and TRL save_to_disk directories under `out`; returns the paths.
    `instruction` names the INSTRUCTIONS entry each prompt ends with."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    if instruction not in INSTRUCTIONS:
        raise ValueError(f"instruction {instruction!r} unknown; valid: {', '.join(INSTRUCTIONS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = build_wordproblem_splits(num_train, num_eval, seed, min_ops, max_ops, max_value,
                                               max_answer_share)
    paths = {}
    for split, problems in (("train", train), ("test", held_out)):
        paths[f"verl/{split}"] = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(verl_rows(problems, split, instruction)), paths[f"verl/{split}"])
        paths[f"trl/{split}"] = out / "trl" / split
        datasets.disable_progress_bars()  # a command-line tool prints its own summary
        datasets.Dataset.from_list(trl_rows(problems, instruction)).save_to_disk(str(paths[f"trl/{split}"]))
    return paths
