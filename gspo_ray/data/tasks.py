"""Built-in tiny tasks for the default recipe: deterministic prompt generators with a disjoint held-out set.

    train, held_out = build_task_splits("copy", num_train=10_000, num_eval=64, seed=0, min_digits=1, max_digits=4)
    train[0]  # TaskExample(prompt='copy:4821=', reference='4821')

copy  "copy:4821=" -> "4821"   (a string of min..max digits, leading zeros allowed)
add   "12+34="     -> "46"     (two numbers of min..max digits each, no leading zeros)
repeat "Repeat exactly: 48213" -> "48213"   (for real models with a chat template; min..max digits, no leading zero)
sum   "What is 47 + 385? Answer with the number only." -> "432"   (chat models; two numbers of min..max digits)
sort  "Sort the digits 5 2 9 1 from smallest to largest. Answer with the digits only." -> "1259"
      (chat models; min..max digits, repeats allowed)
guess "0-9:"       -> "7"      (multi-turn, `gspo_ray.envs.guess`: the reference is the secret the env hides)

copy/add/guess use only characters of the tiny tokenizer's alphabet ("0123456789copy:=+-*", `gspo_ray.models.tiny`).
copy/add: sampling picks a digit count uniformly, then a string uniformly within it, without replacement; so short
strings are not swamped by long ones (there are 10 one-digit strings but 10,000 four-digit ones). The held-out set
is drawn first from its own seed stream, so it does not change with `num_train`, and training draws skip it.
guess: every prompt reads the same, so nothing can be held out by text; what must generalise is the search. The
held-out set covers every secret of [guess_low, guess_high] equally often (see `build_guess_splits`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

DIGIT_TASKS = ("copy", "add", "repeat", "sum", "sort")  # single-turn, scored against the reference by a reward function
TASKS = DIGIT_TASKS + ("guess",)
# Strata up to this size are drawn from a shuffled index list (exact, exhaustible); larger ones by rejection.
_PERMUTE_LIMIT = 20_000
_MAX_REJECTIONS = 1000
# The held-out set takes at most this share of each digit count, so short lengths (10 one-digit strings) are
# still trained on.
_EVAL_MAX_FRACTION = 0.25


@dataclass(frozen=True)
class TaskExample:
    """One prompt string and the exact answer the reward compares against."""

    prompt: str
    reference: str


def _num_count(digits: int) -> int:
    """How many numbers have exactly `digits` digits without leading zeros (0 counts as one digit)."""
    return 10 if digits == 1 else 9 * 10 ** (digits - 1)


def _num_low(digits: int) -> int:
    return 0 if digits == 1 else 10 ** (digits - 1)


def _strata(task: str, min_digits: int, max_digits: int) -> list[tuple[int, Callable[[int], TaskExample]]]:
    """(size, index -> example) per digit-count stratum; each map is a bijection from range(size)."""
    if task not in DIGIT_TASKS:
        raise ValueError(f"unknown task {task!r}; valid: {', '.join(TASKS)}")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got min_digits={min_digits}, max_digits={max_digits}")
    digits = range(min_digits, max_digits + 1)
    if task == "copy":
        def copy_at(d: int) -> Callable[[int], TaskExample]:
            return lambda i: TaskExample(f"copy:{i:0{d}d}=", f"{i:0{d}d}")
        return [(10 ** d, copy_at(d)) for d in digits]
    if task == "repeat":
        def repeat_at(d: int) -> Callable[[int], TaskExample]:
            return lambda i: TaskExample(f"Repeat exactly: {_num_low(d) + i}", str(_num_low(d) + i))
        return [(_num_count(d), repeat_at(d)) for d in digits]
    if task == "sort":
        def sort_at(d: int) -> Callable[[int], TaskExample]:
            def make(i: int) -> TaskExample:
                ds = f"{i:0{d}d}"
                return TaskExample(f"Sort the digits {' '.join(ds)} from smallest to largest. Answer with the "
                                   "digits only.", "".join(sorted(ds)))
            return make
        return [(10 ** d, sort_at(d)) for d in digits]
    if task == "sum":
        def sum_at(da: int, db: int) -> Callable[[int], TaskExample]:
            def make(i: int) -> TaskExample:
                a, b = _num_low(da) + i // _num_count(db), _num_low(db) + i % _num_count(db)
                return TaskExample(f"What is {a} + {b}? Answer with the number only.", str(a + b))
            return make
        return [(_num_count(da) * _num_count(db), sum_at(da, db)) for da in digits for db in digits]

    def add_at(da: int, db: int) -> Callable[[int], TaskExample]:
        def make(i: int) -> TaskExample:
            a, b = _num_low(da) + i // _num_count(db), _num_low(db) + i % _num_count(db)
            return TaskExample(f"{a}+{b}=", str(a + b))
        return make
    return [(_num_count(da) * _num_count(db), add_at(da, db)) for da in digits for db in digits]


def task_space_size(task: str, min_digits: int = 1, max_digits: int = 4, *, guess_low: int = 0,
                    guess_high: int = 9) -> int:
    """Number of distinct examples the task can produce with this digit range (guess: distinct secrets)."""
    if task == "guess":
        _check_guess_range(guess_low, guess_high)
        return guess_high - guess_low + 1
    return sum(size for size, _ in _strata(task, min_digits, max_digits))


class _Stratum:
    """Draws distinct indices of one stratum: a lazily shuffled list when small, rejection sampling when huge."""

    def __init__(self, size: int, make: Callable[[int], TaskExample], rng: random.Random, limit: int):
        self.size, self.make, self.rng, self.limit = size, make, rng, limit
        self.order: list[int] | None = None
        self.pos = 0
        self.seen: set[int] = set()
        self.drawn = 0

    def draw(self) -> int | None:
        """Next unused index, or None when the stratum is exhausted (or has given `limit` indices)."""
        if self.drawn >= self.limit:
            return None
        self.drawn += 1
        if self.size <= _PERMUTE_LIMIT:
            if self.order is None:
                self.order = self.rng.sample(range(self.size), self.size)
            if self.pos == self.size:
                return None
            self.pos += 1
            return self.order[self.pos - 1]
        for _ in range(_MAX_REJECTIONS):
            i = self.rng.randrange(self.size)
            if i not in self.seen:
                self.seen.add(i)
                return i
        return None


def _draw_examples(task: str, n: int, rng: random.Random, min_digits: int, max_digits: int,
                   exclude: frozenset[str] = frozenset(), max_fraction: float = 1.0) -> list[TaskExample]:
    """Up to n distinct examples not in `exclude`, at most `max_fraction` of any stratum (fewer only when the
    task space runs out)."""
    strata = [_Stratum(size, make, rng, max(1, int(size * max_fraction)))
              for size, make in _strata(task, min_digits, max_digits)]
    out: list[TaskExample] = []
    while len(out) < n and strata:
        k = rng.randrange(len(strata))
        i = strata[k].draw()
        if i is None:
            strata.pop(k)
            continue
        example = strata[k].make(i)
        if example.prompt not in exclude:
            out.append(example)
    return out


def build_task_splits(task: str, num_train: int, num_eval: int, seed: int = 0, min_digits: int = 1,
                      max_digits: int = 4, *, guess_low: int = 0, guess_high: int = 9
                      ) -> tuple[list[TaskExample], list[TaskExample]]:
    """(train, held-out eval) examples of a built-in task: deterministic in `seed`, disjoint by prompt (copy, add;
    guess has one prompt text: see `build_guess_splits`).

    The eval set is drawn first from the "eval" seed stream (so it is the same for any num_train), taking at most
    a quarter of each digit count; training examples come from the "train" stream and skip eval prompts. The
    training pool is smaller than num_train only when the task has fewer distinct prompts left.
    """
    if num_train < 1 or num_eval < 0:
        raise ValueError(f"need num_train >= 1 and num_eval >= 0, got {num_train} and {num_eval}")
    if task == "guess":
        return build_guess_splits(num_train, num_eval, seed, guess_low, guess_high)
    held_out = _draw_examples(task, num_eval, random.Random(f"gspo_ray.tasks:{task}:{seed}:eval"),
                              min_digits, max_digits, max_fraction=_EVAL_MAX_FRACTION)
    if len(held_out) < num_eval:
        space = task_space_size(task, min_digits, max_digits)
        raise ValueError(f"data.num_eval={num_eval} is too many: task {task!r} with {min_digits}..{max_digits} "
                         f"digits has {space} distinct prompts and the held-out set may take only "
                         f"{len(held_out)} (a quarter of each digit count)")
    train = _draw_examples(task, num_train, random.Random(f"gspo_ray.tasks:{task}:{seed}:train"),
                           min_digits, max_digits, exclude=frozenset(e.prompt for e in held_out))
    return train, held_out


def guess_prompt(low: int, high: int) -> str:
    """The guessing game's prompt text; the same as `gspo_ray.envs.guess.build_guess_prompts` writes."""
    return f"{low}-{high}:"


def _check_guess_range(low: int, high: int) -> None:
    if not 0 <= low <= high:
        raise ValueError(f"guess task: need 0 <= data.guess_low <= data.guess_high, got {low} and {high}")


def build_guess_splits(num_train: int, num_eval: int, seed: int = 0, low: int = 0,
                       high: int = 9) -> tuple[list[TaskExample], list[TaskExample]]:
    """(train, held-out eval) examples of the guessing game: prompt "<low>-<high>:", reference = the secret.

    Training secrets are uniform draws from the "train" seed stream (repeats are fine: each is one group).
    The held-out set is balanced, every secret equally often (a `num_eval` that is a multiple of the range size
    makes the greedy eval an exact average over secrets), in an order from its own "eval" stream; so it does not
    change with `num_train`.
    """
    _check_guess_range(low, high)
    secrets = list(range(low, high + 1))
    train_rng = random.Random(f"gspo_ray.tasks:guess:{seed}:train")
    train = [TaskExample(guess_prompt(low, high), str(train_rng.choice(secrets))) for _ in range(num_train)]
    eval_rng = random.Random(f"gspo_ray.tasks:guess:{seed}:eval")
    cycle = eval_rng.sample(secrets, len(secrets))
    held_out = [TaskExample(guess_prompt(low, high), str(cycle[i % len(cycle)])) for i in range(num_eval)]
    return train, held_out
