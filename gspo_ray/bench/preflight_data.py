"""The data preflight at dataset scale: GSM8K-like rows read and their references checked by math_verify_reward's
`check_reference` in worker processes, then again with the run directory's verdicts (a --resume).

    flock /tmp/gspo-heavy.lock .venv/bin/gspo-ray bench --suite preflight          # 100k rows
    .venv/bin/gspo-ray bench --suite preflight --quick                             # 10k rows

Rows: a verl-layout parquet file (chat prompt, `reward_model.ground_truth` = a whole GSM8K-style solution ending
in `#### N`, every solution and question distinct, ~28k distinct answers per 100k rows), checked as
`gspo-ray train` checks them (`parse_data`: read_rows, then the references). Beside it: LaTeX answers
(`\\frac{a}{b}`, all distinct), which math-verify must parse, to show what the worker processes give when every
reference costs a parse; and one process's parse per reference, the serial cost the processes divide.
"""
from __future__ import annotations

import os
import random
import resource
import tempfile
import time
from pathlib import Path

from gspo_ray.config import JobConfig
from gspo_ray.preflight.data import parse_data
from gspo_ray.preflight.plugins import import_reward
from gspo_ray.preflight.references import default_workers
from gspo_ray.preflight.verdicts import DataVerdicts

REWARD = "gspo_ray.envs.rewards:math_verify_reward"


def gsm8k_like_rows(n: int, seed: int = 0, latex: bool = False) -> list[dict]:
    """`n` verl-layout rows of two-step word problems with GSM8K-style solutions (`<<a*b=c>>` calculations, the
    final answer after `####`); `latex`: the answer is a distinct `\\frac{p}{q}` instead of an integer."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b, c = rng.randint(2, 500), rng.randint(2, 60), rng.randint(2, 9)
        total = (a + a * b) * c
        question = (f"Natalia sold clips to {a} of her friends in April, and then she sold {b} times as many clips in "
                    f"May. Each clip costs ${c}. How much money did Natalia make in April and May? (shop {i})")
        answer = f"\\frac{{{total}}}{{{i + 1}}}" if latex else str(total)
        solution = (f"Natalia sold {a}*{b} = <<{a}*{b}={a * b}>>{a * b} clips in May.\n"
                    f"Natalia sold {a}+{a * b} = <<{a}+{a * b}={a + a * b}>>{a + a * b} clips altogether.\n"
                    f"She made {a + a * b}*{c} = <<{a + a * b}*{c}={total}>>{total} dollars.\n#### {answer}")
        rows.append({"data_source": "gsm8k", "prompt": [{"role": "user", "content": question}],
                     "reward_model": {"style": "rule", "ground_truth": solution}, "extra_info": {"index": i}})
    return rows


def _job(path: Path, run_dir: Path) -> JobConfig:
    return JobConfig.model_validate({
        "name": "bench-preflight", "logging": {"out_dir": str(run_dir)},
        "data": {"source": "parquet", "path": str(path), "prompt_field": "prompt",
                 "reference_field": "reward_model.ground_truth", "apply_chat_template": True},
        "rollout": {"reward": {"fn": REWARD}}})


def _cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the worker processes), user + system."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of fn(): on a loaded machine the wall time grows, the CPU time much less."""
    start, cpu = time.perf_counter(), _cpu_s()
    fn()
    return time.perf_counter() - start, _cpu_s() - cpu


def _serial_ms(rows: list[dict], n: int = 500) -> tuple[float, float]:
    """One process's parse per reference (wall ms, CPU ms), over `n` references not seen before."""
    from gspo_ray.envs.rewards import parse_math_reference

    refs = [r["reward_model"]["ground_truth"] for r in rows[:n]]
    parse_math_reference(refs[0])  # math-verify's import is not a reference's cost
    wall, cpu = _timed(lambda: [parse_math_reference(r) for r in refs[1:]])
    return 1e3 * wall / (len(refs) - 1), 1e3 * cpu / (len(refs) - 1)


def bench_preflight(rows: int, latex_rows: int) -> list[tuple[str, int, float, float]]:
    """(case, rows, wall seconds, CPU seconds) for each case; prints the table."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = []
    with tempfile.TemporaryDirectory(prefix="bench-preflight-") as tmp:
        for label, n, latex in (("integer answers", rows, False), ("LaTeX answers", latex_rows, True)):
            data = gsm8k_like_rows(n, latex=latex)
            path = Path(tmp) / f"{'latex' if latex else 'gsm8k'}.parquet"
            pq.write_table(pa.Table.from_pylist(data), path)
            cfg = _job(path, Path(tmp) / "runs")
            reward = import_reward(cfg, 60.0)
            verdicts = DataVerdicts(cfg.run_dir)
            out.append((f"{label}: read + check", n, *_timed(lambda: parse_data(cfg, reward, verdicts))))
            verdicts.save()
            out.append((f"{label}: again (--resume, verdict kept)", n,
                        *_timed(lambda: parse_data(cfg, reward, DataVerdicts(cfg.run_dir)))))
            out.append((f"{label}: one process's parse, extrapolated", n, *(ms * n / 1e3 for ms in _serial_ms(data))))
    print(f"data preflight, GSM8K-like verl parquet rows, {default_workers()} worker processes, load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    print(f"{'case':<52} {'rows':>8} {'wall s':>8} {'CPU s':>8} {'rows/s':>9}")
    for case, n, wall, cpu in out:
        print(f"{case:<52} {n:>8} {wall:>8.1f} {cpu:>8.1f} {n / wall:>9.0f}")
    return out


def run_preflight_bench(quick: bool = False) -> None:
    bench_preflight(10_000 if quick else 100_000, 2_000 if quick else 10_000)
