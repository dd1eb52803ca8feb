"""`gspo-ray eval`: score a model or a checkpoint on a JSONL file without training, with vLLM in this process.

    gspo-ray eval runs/my-run --data data/test.jsonl                          # latest checkpoint; run's reward
    gspo-ray eval runs/my-run                                                 # the run's own held-out prompts
    gspo-ray eval base-model/ --config recipe.yaml                            # the same prompts, before training
    gspo-ray eval exported/ --data test.jsonl --reward my_rewards:score --n 8 --temperature 1.0

MODEL is a HF model directory, a run directory (its latest checkpoint), a `checkpoints/step_N` directory or a
trainer checkpoint. A checkpoint is served from its `hf/` directory when training exported one, else exported to a
temporary directory first. Sampling limits, the reward and the prompt fields default to the run's `config.yaml`
(or `--config FILE`), so a checkpoint is scored exactly as the in-training eval scored it; flags override them.
Without `--data`, the prompts are the job's held-out set (the built-in task's eval split, or `data.eval_path`): the
in-training evaluation's prompts, so the figures before and after training can be reproduced from the command line.
Generation and scoring go through `evaluation.run_eval`, the in-training eval's own path.

Output: `--out FILE`, else inside the run directory when MODEL is in one (`<run_dir>/eval/cli_<data>_step_N.jsonl`),
else `eval-<data>.jsonl` in the current directory; its `.summary.json` records the model, the checkpoint step
(None for a model directory that is not a checkpoint) and the data it scored. vLLM's two warnings about its missing
tokenizer (the engine takes ids, on purpose) are filtered out (rollout/vllm_quiet.py).
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gspo_ray.config import DataConfig, RolloutConfig
from gspo_ray.coordinator.evaluation import EvalResult, run_eval, write_eval_samples
from gspo_ray.coordinator.export import HF_DIR, resolve_checkpoint


@dataclass
class EvalOptions:
    """What `gspo-ray eval` was asked; None = take it from the run's (or --config's) job config."""

    data: Path | None = None  # None: the job's held-out prompts (built-in eval split or data.eval_path)
    reward: str | None = None
    reward_kwargs: dict[str, Any] | None = None
    n: int = 1
    temperature: float | None = None  # default: 0 (greedy) for n = 1, the config's temperature for n > 1
    max_new_tokens: int | None = None
    max_model_len: int | None = None
    prompt_field: str | None = None
    reference_field: str | None = None
    chat: bool | None = None
    pass_threshold: float = 1.0
    config: Path | None = None  # a job YAML to take defaults from
    model_dir: Path | None = None  # the HF model a checkpoint was trained from (when not inside a run directory)


class LocalRollout:
    """One RolloutWorker in this process behind the `generate` interface of the rollout pool (no Ray)."""

    def __init__(self, model_dir: Path, cfg: RolloutConfig, work_dir: Path):
        from gspo_ray.rollout.vllm_quiet import quiet_tokenizerless_engine
        from gspo_ray.rollout.worker import RolloutWorker

        quiet_tokenizerless_engine()
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # as in training: the summary, not vLLM's start-up
        self.worker = RolloutWorker(0, str(model_dir), cfg, str(work_dir), reward_runner=cfg.reward)
        self.multi_turn = cfg.multi_turn is not None or cfg.agent is not None  # episodes: run_episodes

    def generate(self, prompts, n: int, temperature: float | None = None):
        from gspo_ray.coordinator.rollout_pool import assemble_groups

        call = self.worker.run_episodes if self.multi_turn else self.worker.generate
        samples = call(prompts, n, temperature=temperature)
        return assemble_groups(prompts, samples, n), self.worker.last_metrics()

    def shutdown(self) -> None:
        self.worker.shutdown()


def run_dir_of(target: Path) -> Path | None:
    """The run directory MODEL is in (itself, a checkpoint of it, its hf/ export), or None."""
    for parent in (target, *target.parents):
        if (parent / "config.yaml").is_file() and (parent / "checkpoints").is_dir():
            return parent
    return None


def default_out(target: Path, data: Path | None, step: int | None) -> Path:
    """Where the samples go without --out: the run directory's eval/ when MODEL is in one, else the cwd."""
    name = data.stem if data is not None else "held-out"
    run_dir = run_dir_of(target)
    if run_dir is None:
        return Path(f"eval-{name}.jsonl")
    return run_dir / "eval" / (f"cli_{name}" + ("" if step is None else f"_step_{step:06d}") + ".jsonl")


def _step_of(path: Path) -> int | None:
    """The checkpoint step a served directory belongs to (checkpoints/step_N/...), else None."""
    found = next((re.fullmatch(r"step_(\d+)", p.name) for p in (path, *path.parents)
                  if re.fullmatch(r"step_(\d+)", p.name)), None)
    return int(found.group(1)) if found else None


def _job_section(target: Path, opts: EvalOptions) -> dict:
    """The raw job config the defaults come from: --config, else the run's config.yaml, else nothing."""
    path = opts.config
    if path is None:
        run_dir = run_dir_of(target)
        path = run_dir / "config.yaml" if run_dir is not None else None
    if path is None:
        return {}
    if not Path(path).is_file():
        raise FileNotFoundError(f"--config {path}: file not found")
    return yaml.safe_load(Path(path).read_text()) or {}


def settings(raw: dict, opts: EvalOptions) -> tuple[RolloutConfig, DataConfig]:
    """Rollout and data settings: the job config's (`raw`) defaults, then the command's flags (validated like the
    job's)."""
    rollout = dict(raw.get("rollout") or {}, num_workers=1)  # one engine, unpinned
    if opts.reward is not None:
        same = (rollout.get("reward") or {}).get("fn") == opts.reward
        rollout["reward"] = {**((rollout.get("reward") or {}) if same else {}), "fn": opts.reward}
    if opts.reward_kwargs is not None:
        rollout["reward"] = {**(rollout.get("reward") or {}), "kwargs": opts.reward_kwargs}
    for key, value in (("max_new_tokens", opts.max_new_tokens), ("max_model_len", opts.max_model_len)):
        if value is not None:
            rollout[key] = value
    data = {k: v for k, v in (raw.get("data") or {}).items()
            if k in ("prompt_field", "reference_field", "apply_chat_template")}
    for key, value in (("prompt_field", opts.prompt_field), ("reference_field", opts.reference_field),
                       ("apply_chat_template", opts.chat)):
        if value is not None:
            data[key] = value
    return RolloutConfig.model_validate(rollout), DataConfig.model_validate({**data, "source": "builtin"})


def held_out_source(raw: dict, target: Path, model_dir: Path, rollout_cfg: RolloutConfig):
    """The job's own held-out prompts (the `data:` section of its config `raw`, as the job built them), for an eval
    without --data."""
    from gspo_ray.data.prompts import PromptSource

    data_cfg = DataConfig.model_validate(raw.get("data") or {})
    source = PromptSource.from_config(data_cfg, str(model_dir), split="eval",
                                      max_new_tokens=rollout_cfg.max_new_tokens,
                                      max_model_len=rollout_cfg.max_model_len)
    if source is None:
        raise ValueError(f"{target}: no --data, and the job has no held-out prompts (data.num_eval is 0 or "
                         "data.eval_path is not set)")
    return source


def model_to_serve(target: Path, opts: EvalOptions, stack: ExitStack) -> tuple[Path, int | None]:
    """(HF directory, checkpoint step): a HF directory as is; a checkpoint's exported `hf/`, or a fresh export in
    a temporary directory."""
    if (target / "config.json").is_file():
        return target, _step_of(target.absolute())
    ref = resolve_checkpoint(target, opts.model_dir)
    step = _step_of(ref.trainer_dir.absolute())
    if ref.step_dir is not None and (ref.step_dir / HF_DIR / "config.json").is_file():
        return ref.step_dir / HF_DIR, step
    from gspo_ray.trainer.weights.hf_export import export_checkpoint

    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gspo-eval-")))
    return export_checkpoint(ref.trainer_dir, ref.model_dir, tmp / "model"), step


def evaluate_model(target: str | Path, opts: EvalOptions, out: str | Path | None = None) -> tuple[EvalResult, Path]:
    """Run the evaluation; write per-sample lines to `out` (None: `default_out`) and the summary to `out` with
    .summary.json."""
    from gspo_ray.data.prompts import PromptSource
    from gspo_ray.rollout.scoring import check_reward

    target = Path(target)
    raw = _job_section(target, opts)
    if opts.data is None and not raw:
        raise ValueError(f"{target}: no --data, and no job config to take the held-out prompts from (a run "
                         "directory's config.yaml, or --config recipe.yaml)")
    rollout_cfg, data_cfg = settings(raw, opts)
    check_reward(rollout_cfg.reward.fn, rollout_cfg.reward.kwargs)  # a bad plug-in fails before vLLM starts
    temperature = opts.temperature if opts.temperature is not None else (
        0.0 if opts.n == 1 else rollout_cfg.temperature)
    if opts.n > 1 and temperature == 0.0:
        raise ValueError(f"--n {opts.n} at temperature 0 gives {opts.n} copies of the greedy completion; "
                         "give --temperature > 0")
    with ExitStack() as stack:
        model_dir, step = model_to_serve(target, opts, stack)
        if opts.data is None:
            source = held_out_source(raw, target, model_dir, rollout_cfg)
        else:
            source = PromptSource.from_jsonl(
                opts.data, str(model_dir), prompt_field=data_cfg.prompt_field,
                reference_field=data_cfg.reference_field, split="eval",
                apply_chat_template=data_cfg.apply_chat_template,
                max_new_tokens=rollout_cfg.max_new_tokens, max_model_len=rollout_cfg.max_model_len)
        prompts = source.prompts()  # tokenised and length-checked before the engine starts
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gspo-eval-engine-")))
        rollout = LocalRollout(model_dir, rollout_cfg, work)
        stack.callback(rollout.shutdown)
        result = run_eval(rollout.generate, prompts, n=opts.n, temperature=temperature,
                          pass_threshold=opts.pass_threshold)
        decode = lambda ids: source.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        out = Path(out) if out is not None else default_out(target, opts.data, step)
        out = write_eval_samples(out, result.groups, decode, opts.pass_threshold)
    summary = {"model": str(target), "served": str(model_dir) if model_dir.exists() else "a temporary export of the checkpoint",
               "step": step, "data": str(opts.data) if opts.data else source.name, "prompts": len(prompts),
               "reward": rollout_cfg.reward.fn, "temperature": temperature,
               "max_new_tokens": rollout_cfg.max_new_tokens, **result.metrics}
    out.with_suffix(".summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return result, out
