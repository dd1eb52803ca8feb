"""Held-out evaluation, one code path for the in-training eval (`coordinator.eval_every`) and `gspo-ray eval`.

    result = run_eval(rollout.generate, prompts, n=1, temperature=0.0)    # greedy: the in-training default
    result.metrics["eval/reward"], result.metrics["eval/pass@1"]
    write_eval_samples(run_dir / "eval" / "step_000025.jsonl", result.groups, tokenizer)

`generate(prompts, n, temperature=...) -> (groups, metrics)` is a `RolloutPool` during training and an engine in
this process for `gspo-ray eval` (`coordinator/eval_run.py`); both score with the job's reward runner, so the
numbers of the two agree for the same weights and prompts.

A sample passes when its reward reports `exact` (copy_reward and friends) and it is 1, otherwise when its reward
is >= `pass_threshold`. pass@1 is the mean over prompts of (passing samples / n), the unbiased estimate; pass@n is
the share of prompts with at least one passing sample (equal to pass@1 for greedy n=1).
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gspo_ray.data.records import Group, Sample


@dataclass
class EvalResult:
    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)


def passed(s: Sample, pass_threshold: float = 1.0) -> bool:
    if s.failed is not None or s.reward is None:
        return False
    if "exact" in s.reward_info:
        return s.reward_info["exact"] >= 1.0
    return s.reward >= pass_threshold


def eval_metrics(groups: list[Group], pass_threshold: float = 1.0) -> dict[str, float]:
    """Mean reward (over scored samples), pass@1, pass@n, mean completion length, finish-reason shares."""
    samples = [s for g in groups for s in g.samples]
    scored = [s.reward for s in samples if s.failed is None and s.reward is not None]
    n = max((len(g.samples) for g in groups), default=0)
    out = {"eval/reward": sum(scored) / max(len(scored), 1), "eval/failed": len(samples) - len(scored),
           "eval/n": n, "eval/prompts": len(groups),
           "eval/pass@1": _mean([sum(passed(s, pass_threshold) for s in g.samples) / len(g.samples) for g in groups]),
           "eval/pass@n": _mean([float(any(passed(s, pass_threshold) for s in g.samples)) for g in groups]),
           "eval/mean_len": _mean([s.num_tokens for s in samples])}
    for reason, count in sorted(Counter(s.finish_reason for s in samples).items()):
        out[f"eval/finish_{reason}"] = count / len(samples)
    exact = [s.reward_info["exact"] for s in samples if "exact" in s.reward_info]
    if exact:
        out["eval/exact"] = _mean(exact)
    # multi-turn environments report their outcome as env/* (env/solved, env/correct): success rates
    for key in sorted({k for s in samples for k in s.reward_info if k.startswith("env/") or k == "turns"}):
        out[f"eval/{key.removeprefix('env/')}"] = sum(s.reward_info.get(key, 0.0) for s in samples) / len(samples)
    return out


def failed_reasons(samples: list[Sample]) -> dict[str, int]:
    """Failure reasons of the samples, grouped as training groups them (coordinator/failures.py)."""
    from gspo_ray.coordinator.failures import count_reason

    reasons: dict[str, int] = {}
    for s in samples:
        if s.failed is not None:
            count_reason(reasons, s.failed)
    return reasons


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def run_eval(generate: Callable[..., tuple[list[Group], dict]], prompts: list, n: int = 1,
             temperature: float = 0.0, pass_threshold: float = 1.0) -> EvalResult:
    """n completions per prompt at `temperature` (0 = greedy), scored by the generator's reward runner."""
    if n > 1 and temperature == 0.0:
        raise ValueError(f"n={n} samples per prompt at temperature 0 would all be the same greedy completion; "
                         "give a temperature > 0")
    groups, _ = generate(prompts, n, temperature=temperature)
    return EvalResult(groups=groups, metrics=eval_metrics(groups, pass_threshold))


def sample_record(g: Group, s: Sample, decode: Callable[[list[int]], Any] | None = None,
                  pass_threshold: float = 1.0) -> dict:
    """One JSON line per evaluated sample: prompt, reference, completion (ids, text, engine log-probs), reward."""
    rec = {"uid": g.uid, "origin": g.prompt.meta.get("origin"), "sample": s.sample_index, "prompt": g.prompt.text,
           "reference": g.prompt.reference, "prompt_ids": s.prompt_ids, "completion_ids": s.completion_ids,
           "logprobs": s.logprobs, "reward": s.reward, "reward_info": s.reward_info,
           "passed": passed(s, pass_threshold), "finish_reason": s.finish_reason, "num_tokens": s.num_tokens,
           "failed": s.failed}
    if decode is not None:
        rec["completion"] = decode(s.completion_ids)
    return rec


def write_eval_samples(path: Path, groups: list[Group], decode: Callable[[list[int]], Any] | None = None,
                       pass_threshold: float = 1.0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for g in groups:
            for s in g.samples:
                f.write(json.dumps(sample_record(g, s, decode, pass_threshold), default=str) + "\n")
    return path


def describe_eval(metrics: dict[str, float]) -> str:
    """The summary `gspo-ray eval` prints."""
    n = int(metrics["eval/n"])
    finish = ", ".join(f"{k.removeprefix('eval/finish_')} {v:.0%}" for k, v in metrics.items()
                       if k.startswith("eval/finish_"))
    lines = [f"prompts      {int(metrics['eval/prompts'])} x {n} sample(s)",
             f"mean reward  {metrics['eval/reward']:.4f}" + (f" ({int(metrics['eval/failed'])} failed)"
                                                             if metrics["eval/failed"] else ""),
             f"pass@1       {metrics['eval/pass@1']:.4f}",
             *([f"pass@{n:<8} {metrics['eval/pass@n']:.4f}"] if n > 1 else []),
             f"mean length  {metrics['eval/mean_len']:.2f} tokens",
             f"finish       {finish}"]
    return "\n".join(lines)


def early_stop_value(metrics: dict[str, float], key: str) -> float | None:
    """The held-out metric early stopping compares (`coordinator.early_stop_metric`); None on a step without an
    evaluation. A key the evaluation did not log is an error naming the field and the keys it did log."""
    if not any(k.startswith("eval/") for k in metrics):
        return None
    if key not in metrics:
        logged = ", ".join(sorted(k for k in metrics if k.startswith("eval/")))
        from gspo_ray.config import ConfigError

        raise ConfigError(f"coordinator.early_stop_metric: {key!r} is not logged by the evaluation (it logs "
                          f"{logged})")
    return metrics[key]
