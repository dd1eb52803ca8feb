"""One training job end to end: validate -> Ray -> pools -> loop (eval, checkpoints, metrics) -> plot -> summary.

    gspo-ray train gspo_ray/recipes/tiny_moe.yaml [--resume]
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from gspo_ray.config import JobConfig
from gspo_ray.coordinator.autoscale_run import autoscale_step, autoscaler_for
from gspo_ray.coordinator.checkpoint import CheckpointManager, checkpoint_bytes
from gspo_ray.coordinator.control import resize_pool, start_control, stop_control
from gspo_ray.coordinator.evaluation import early_stop_value
from gspo_ray.coordinator.export import export_after_save, export_final
from gspo_ray.coordinator.failures import TooManyFailedSamples, failure_line
from gspo_ray.coordinator.loop import Coordinator, LoopState
from gspo_ray.coordinator.ray_node import LocalRayHead
from gspo_ray.coordinator.recovery import RestartsExhausted, TrainerRecovery, restore_checkpoint
from gspo_ray.coordinator.run_dir import RunDirError, prepare_run_dir, redacted_config_dict
from gspo_ray.coordinator.run_lock import RunLock
from gspo_ray.coordinator.signals import StopRequest, StopRequested, exit_code_for, signals_seen
from gspo_ray.coordinator.tracking import MetricsTracker, plot_metrics
from gspo_ray.models.native_bf16 import resolve_job_dtypes
from gspo_ray.rollout.scoring import check_reward
from gspo_ray.rollout.weight_sync import build_probe_sequences

log = logging.getLogger(__name__)


class TrainerFailed(RuntimeError):
    """A trainer worker died and `trainer.max_restarts` in-job recoveries were spent (or it is 0); the job stopped
    with its last checkpoint intact (resume with --resume)."""


@dataclass
class RunSummary:
    run_dir: Path
    steps: int
    eval_history: list[tuple[int, float]] = field(default_factory=list)
    eval_failed: dict[int, int] = field(default_factory=dict)  # step -> held-out samples whose scoring failed
    failed_samples: int = 0  # training samples whose reward or environment failed, this process's steps
    samples: int = 0
    checkpoint: Path | None = None
    plot: Path | None = None
    hf_dir: Path | None = None  # the final policy as a HF model directory (logging.export_hf)
    wall_s: float = 0.0
    interrupted: bool = False
    exit_code: int = 0  # interrupted: 128 + the signal (SIGTERM 143, SIGINT 130), the `train` command's exit code

    def describe(self) -> str:
        evals = ", ".join(f"step {s}: {r:.3f}" + (f" ({self.eval_failed[s]} failed)" if self.eval_failed.get(s)
                                                  else "") for s, r in self.eval_history)
        return (f"run dir     {self.run_dir}\n"
                f"steps       {self.steps} ({self.wall_s:.0f} s){' (interrupted)' if self.interrupted else ''}\n"
                f"failed      {self.failed_samples} of {self.samples} training samples\n"
                f"eval reward {evals or 'n/a'}\n"
                f"metrics     {self.run_dir / 'metrics.jsonl'} (TensorBoard: {self.run_dir / 'tensorboard'})\n"
                # stopped by a signal: the command's last line names the resume point instead
                + ("" if self.interrupted else f"checkpoint  {self.checkpoint}\n") +
                f"hf model    {self.hf_dir}\n"
                f"plot        {self.plot}")


def prepare_model(cfg: JobConfig) -> Path:
    """The HF checkpoint to train: the configured directory, the packaged pretrained model (imported once into
    the model cache shared by all runs, models/cache.py), or the tiny model built into the run dir."""
    if cfg.model.path is not None:
        return cfg.model.path
    if cfg.model.packaged is not None:
        from gspo_ray.models.cache import packaged_model_dir
        from gspo_ray.models.gguf import ensure_imported

        return ensure_imported(packaged_model_dir(cfg.model.packaged, cfg.model.cache_dir))
    from gspo_ray.models.tiny import ensure_tiny_model

    t = cfg.model.tiny
    return ensure_tiny_model(t.arch, cfg.run_dir / "model", seed=t.seed, hidden=t.hidden, layers=t.layers,
                             experts=t.experts, top_k=t.top_k, init_std=t.init_std)


def build_prompt_sources(cfg: JobConfig, model_path: Path):
    """Train and held-out prompt sources, fully validated (tokenised, lengths checked) before any actor starts."""
    from gspo_ray.data.prompts import PromptSource

    limits = dict(max_new_tokens=cfg.rollout.max_new_tokens, max_model_len=cfg.rollout.max_model_len)
    train = PromptSource.from_config(cfg.data, str(model_path), split="train", **limits).validate()
    held_out = PromptSource.from_config(cfg.data, str(model_path), split="eval", **limits)
    return train, held_out.validate() if held_out is not None else None


def init_ray(cfg: JobConfig) -> LocalRayHead | None:
    """Join `cluster.address`, or start a local instance. Returns the local instance's head when this process
    started one (`shutdown_ray` ends it), else None.

    The local instance is a `ray start --head` this process owns, in a session of its own (coordinator/ray_node.py):
    a SIGTERM to the job's process group (`timeout`, a wrapper script, a container's init) reaches the driver, which
    finishes its step and saves, and not Ray's processes under it. The head dies with the driver however it dies."""
    import ray

    if ray.is_initialized():
        return None
    env = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1", "VLLM_LOGGING_LEVEL": "WARNING",
                        "TOKENIZERS_PARALLELISM": "false", **cfg.cluster.runtime_env.get("env_vars", {})}}
    env.update({k: v for k, v in cfg.cluster.runtime_env.items() if k != "env_vars"})
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=cfg.cluster.namespace, runtime_env=env, log_to_driver=False)
        return None
    # No idle worker processes kept around: the job's actors have their own. Without this, a local instance that ran
    # one task kept 2 idle workers (0.11 GiB PSS) 8 s later; with it, none.
    head = LocalRayHead(num_cpus=cfg.cluster.num_cpus,
                        system_config={"num_workers_soft_limit": 0, "prestart_worker_first_driver": False})
    try:
        head.start()
        ray.init(address=head.address, namespace=cfg.cluster.namespace, runtime_env=env, log_to_driver=False)
    except BaseException:
        ray.shutdown()
        head.stop()
        raise
    return head


def shutdown_ray(head: LocalRayHead | None) -> None:
    """Leave Ray; with the head `init_ray` started, end that instance too (its workers, raylet and GCS)."""
    import ray

    if head is None:
        return
    ray.shutdown()
    head.stop()


def evaluate(rollout, prompts, step: int, run_dir: Path | None = None, note=None) -> dict[str, float]:
    """Greedy completions of the held-out prompts (`evaluation.run_eval`, the path `gspo-ray eval` takes too):
    mean reward, pass@1, exact-match rate, lengths; with run_dir, per-sample lines in eval/step_N.jsonl.
    `note(line)`: where the line about samples whose scoring failed goes (their share and first reason)."""
    from gspo_ray.coordinator.evaluation import failed_reasons, run_eval, write_eval_samples

    result = run_eval(rollout.generate, prompts.prompts(), n=1, temperature=0.0)
    samples = [s for g in result.groups for s in g.samples]
    line = failure_line(step, int(result.metrics["eval/failed"]), len(samples), failed_reasons(samples))
    if note is not None and line is not None:
        note(f"eval {line}")
    if run_dir is not None:
        decode = lambda ids: prompts.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        write_eval_samples(run_dir / "eval" / f"step_{step:06d}.jsonl", result.groups, decode)
    return result.metrics


def run_job(cfg: JobConfig, resume: bool = False, rollout_factory=None, after_step=None,
            fresh: bool = False, stop: StopRequest | None = None) -> RunSummary:
    """Run one job. `rollout_factory(worker_id)` overrides how rollout actors are made; `after_step(coord, step)`
    is called after each step's metrics and checkpoint are written (callbacks, fault injection in tests).
    Without `resume` or `fresh`, a run directory that already holds a run's outputs is refused (RunDirError);
    one that another live job holds is refused (run_lock.RunLockError), before `fresh` deletes anything.
    SIGTERM/SIGINT stop the job at the next step boundary with a checkpoint (coordinator/signals.py); `stop`: the
    caller's StopRequest (`gspo-ray train` installs one before its preflight), else one for the job's life. A
    second signal raises StopRequested(immediate=True) out of here."""
    own = stop is None
    stop = StopRequest().install() if own else stop
    try:
        stop.raise_if_requested()  # a signal during the preflight: nothing started yet
        with RunLock(cfg.run_dir) as lock:  # held for the job's life, released however it ends
            return _run_locked(cfg, resume, rollout_factory, _renewing(lock, after_step), fresh, stop)
    finally:
        if own:
            stop.restore()


def _renewing(lock: RunLock, after_step=None):
    """The job's `after_step` hook with the run lock's lease renewed first, at every step boundary."""
    def hook(coord, step):
        lock.refresh()
        if after_step is not None:
            after_step(coord, step)
    return hook


def _start_ray(cfg: JobConfig, stop: StopRequest) -> LocalRayHead | None:
    """`init_ray`, then the signals back from Ray (whose handler exits the driver on SIGTERM). A SIGTERM while
    Ray starts (its handler's SystemExit) is a stop request like any other."""
    import signal

    import ray

    try:
        with signals_seen() as seen:
            head = init_ray(cfg)
    except SystemExit as e:
        if e.code != signal.SIGTERM:
            raise
        ray.shutdown()  # whatever the interrupted start left running (init_ray stopped its head)
        stop.signum = stop.signum or signal.SIGTERM
        raise StopRequested(stop.signum) from None
    stop.install()  # after ray.init, whose SIGTERM handler aborts the driver
    if signal.SIGTERM in seen and not stop.requested:  # Ray's handler ran, its SystemExit was lost
        stop.signum = signal.SIGTERM  # the caller's raise_if_requested stops before the pools
    return head


def _run_locked(cfg: JobConfig, resume: bool, rollout_factory, after_step, fresh: bool,
                stop: StopRequest) -> RunSummary:
    from gspo_ray.coordinator.pools import build_pools

    t_start = time.perf_counter()
    cfg, dtype_lines = resolve_job_dtypes(cfg)  # once, before anything is built: every part sees the same dtype
    for line in dtype_lines:
        print(line, file=sys.stderr, flush=True)
    run_dir = prepare_run_dir(cfg, resume=resume, fresh=fresh)  # before any expensive work
    model_path = prepare_model(cfg)
    train_prompts, eval_prompts = build_prompt_sources(cfg, model_path)
    check_reward(cfg.rollout.reward.fn, cfg.rollout.reward.kwargs)  # a bad plug-in fails before any actor starts
    ckpts = CheckpointManager(run_dir, keep=cfg.coordinator.keep_checkpoints)
    state, latest = LoopState(), ckpts.latest() if resume else None
    if resume and latest is None:
        if (run_dir / "metrics.jsonl").exists():  # never append a second run to the first one's metrics
            raise RunDirError(f"--resume: no complete checkpoint in {ckpts.root}; pass --fresh to start over")
        log.warning("--resume: no checkpoint in %s, starting from scratch", ckpts.root)
    stop.raise_if_requested()  # a signal while the model and data were prepared: no Ray, no pools
    ray_head = _start_ray(cfg, stop)
    after_step = stop.check_after(after_step)
    trainer = rollout = tracker = control = None
    summary = RunSummary(run_dir=run_dir, steps=0)
    try:
        stop.raise_if_requested()  # a signal while Ray started: no pools (the finally stops Ray)
        # first: a job whose name a live job holds is refused before any pool starts
        control = start_control(cfg.name, cfg.cluster.namespace)
        trainer, rollout = build_pools(cfg, model_path, run_dir, rollout_factory)
        coord = Coordinator(cfg, rollout, trainer, train_prompts, state)
        coord.probe_sequences = build_probe_sequences(  # long enough to reach every expert of an MoE
            len(train_prompts.tokenizer), cfg.rollout.max_model_len - 1,
            json.loads((Path(model_path) / "config.json").read_text()), seed=cfg.seed)
        if latest is not None:  # the same path in-job trainer recovery takes (coordinator/recovery.py)
            restore_checkpoint(coord, ckpts, latest)
        elif cfg.trainer.lora is not None and cfg.trainer.lora.init_from is not None:
            coord.sync_weights()  # the engines start from the base model: step 0 already samples the given adapter
        summary.steps = coord.state.step
        tracker = MetricsTracker(run_dir, cfg.coordinator.steps, coord.state.step, cfg.logging.tensorboard,
                                 cfg.logging.progress, wandb=cfg.logging.wandb,
                                 run_config=redacted_config_dict(cfg))  # no secrets to the tracker
        summary.interrupted = _loop(cfg, coord, eval_prompts, tracker, ckpts, summary, control, after_step,
                                    model_path=model_path, job_start=t_start, stop=stop)
        summary.exit_code = exit_code_for(stop.signum) if summary.interrupted else 0
    finally:
        with stop.quiet():  # a signal now must not cut the shutdown half-way (Ray processes left behind)
            if control is not None:
                stop_control(control)  # the name is free for the next job of this name
            if tracker is not None:
                tracker.close()
            for pool in (rollout, trainer):
                if pool is not None:
                    pool.shutdown()
            shutdown_ray(ray_head)
    # the pools are gone: the conversion reads the checkpoint files, with this machine's memory to itself
    summary.hf_dir = export_final(cfg.logging, run_dir, summary.checkpoint, model_path)
    if cfg.logging.plot and (run_dir / "metrics.jsonl").exists():
        summary.plot = plot_metrics(run_dir / "metrics.jsonl", run_dir / "training.png")
    summary.wall_s = time.perf_counter() - t_start
    return summary


def _loop(cfg: JobConfig, coord: Coordinator, eval_prompts, tracker, ckpts, summary: RunSummary, control,
          after_step=None, model_path: Path | None = None, job_start: float | None = None,
          stop: StopRequest | None = None) -> bool:
    """Steps until done; evaluates and checkpoints on schedule. Returns True when interrupted by the user.
    Every logged step carries `time/job_s`, the seconds since the job started (`job_start`, perf_counter; pool
    start-up and evaluations included), so a curve can be read against wall time.

    Only step boundaries are saved: an interrupt inside a step (or a second signal, `StopRequested.immediate`)
    leaves the last checkpoint as the resume point; a signal before the first step stops before it (`stop`).
    A dead trainer rank is recovered in-job (coordinator/recovery.py: rebuild, rewind to the last checkpoint,
    replay) up to `trainer.max_restarts` times; then TrainerFailed."""
    from ray.exceptions import RayActorError

    c = cfg.coordinator
    job_start = time.perf_counter() if job_start is None else job_start
    saved_at = [coord.state.step if coord.state.step else None]  # a resumed run's step is already checkpointed
    recovery = TrainerRecovery.for_job(cfg, coord, ckpts)
    scaler = autoscaler_for(cfg, lambda n: coord.trainer.cfg.resize_problem(n))  # coordinator.autoscale

    def rescale_trainer(n: int):  # the one trainer resize both the autoscaler and `gspo-ray scale` go through
        return recovery.rescale(coord, n, save)

    coord.rollout.track_busy = scaler is not None
    sized: list[bool] = []  # the first save of this process printed its size

    last_save = [time.perf_counter()]  # the job's first step counts from here (checkpoint_every_s)

    def save() -> Path:
        if saved_at[0] != coord.state.step:  # once per step (early stop right after a checkpoint step, Ctrl-C)
            summary.checkpoint = ckpts.save(coord.state, coord.trainer.save, {
                "prompts": coord.prompts.state_dict(), "coordinator": coord.state_dict()})
            saved_at[0] = coord.state.step
            if not sized:  # once per job: what a checkpoint costs on disk, and what retention keeps
                sized.append(True)
                tracker.note(checkpoint_size_line(summary.checkpoint, c.keep_checkpoints))
            export_after_save(cfg.logging, summary.checkpoint, model_path)  # logging.export_hf: every_checkpoint
        last_save[0] = time.perf_counter()
        return summary.checkpoint

    in_step = False
    check_stop = stop.raise_if_requested if stop is not None else (lambda: None)
    try:
        check_stop()  # a signal during start-up: no step, no evaluation
        if eval_prompts is not None and coord.state.step == 0:
            m = evaluate(coord.rollout, eval_prompts, 0, cfg.run_dir, tracker.note)
            if c.early_stop_reward is not None:  # a metric the evaluation does not log fails here, before training
                early_stop_value(m, c.early_stop_metric)
            _record_eval(summary, 0, m)
            tracker.log(0, {**m, "time/job_s": time.perf_counter() - job_start}, advance=False)
        while coord.state.step < c.steps:
            check_stop()  # before the first step too (and after an in-job recovery)
            in_step = True
            try:
                metrics = coord.step()
                in_step = False
                step = coord.state.step
                _note_failures(summary, tracker, step, coord.last_failures)
                last = step == c.steps
                if eval_prompts is not None and ((c.eval_every and step % c.eval_every == 0) or last):
                    m = evaluate(coord.rollout, eval_prompts, step, cfg.run_dir, tracker.note)
                    metrics.update(m)
                    _record_eval(summary, step, m)
                metrics.update(recovery.step_metrics(step))
                metrics["time/job_s"] = time.perf_counter() - job_start
                if scaler is not None:  # before `gspo-ray scale` requests, which then have the last word
                    autoscale_step(scaler, coord, metrics, rescale_trainer, step, time.perf_counter() - job_start)
                _apply_control(coord, control, metrics, rescale_trainer, refused=recovery)
                tracker.log(step, metrics)
                if cfg.logging.save_rollouts:
                    write_rollouts(cfg.run_dir / "rollouts" / f"step_{step:06d}.jsonl", coord.last_groups)
                summary.steps = step
                if checkpoint_due(step, c.checkpoint_every, last, c.checkpoint_every_s,
                                  time.perf_counter() - last_save[0]):
                    save()
            except Exception as e:  # rollout deaths are absorbed by the pool: a trainer rank, or not ours
                if isinstance(e, TooManyFailedSamples):  # the step's line first, then the stop's
                    _note_failures(summary, tracker, coord.state.step + 1, coord.last_failures)
                if not recovery.is_trainer_death(coord, e):
                    if isinstance(e, RayActorError):
                        raise TrainerFailed(f"a worker died and could not be replaced ({e}); last checkpoint: "
                                            f"{ckpts.latest()}") from e
                    raise
                try:
                    restored = recovery.recover(coord, e, summary)
                except RestartsExhausted as spent:
                    raise TrainerFailed(f"a trainer worker died ({e}; {spent}); last checkpoint: "
                                        f"{ckpts.latest()}") from e
                saved_at[0] = coord.state.step if restored is not None else None
                tracker.rewind(coord.state.step)  # TensorBoard drops the dead steps' events
                in_step = False
                continue
            if after_step is not None:
                after_step(coord, step)
            value = early_stop_value(metrics, c.early_stop_metric) if c.early_stop_reward is not None else None
            if value is not None and value >= c.early_stop_reward:
                save()
                break
    except KeyboardInterrupt as e:
        if in_step or getattr(e, "immediate", False):
            # the trainer may be partway into the next step while the loop state is not: never mix them; a second
            # signal: nothing more is written
            summary.checkpoint = ckpts.resume_point()
            log.warning("interrupted during step %d: nothing saved", coord.state.step + 1)
        elif coord.state.step > 0:  # step 0 (a signal during start-up) has nothing worth a checkpoint
            save()
        return True
    coord.failures.check_end()  # a run whose every step failed too often is not a success, however short
    return False


def checkpoint_due(step: int, every: int, last: bool, every_s: float, since_save_s: float) -> bool:
    """Whether this step boundary saves: every `every` steps, the last step, or once `every_s` seconds have passed
    since the last save (so at most every_s + one step of work is lost to a death; 0 turns either rule off)."""
    return bool((every and step % every == 0) or last or (every_s and since_save_s >= every_s))


def checkpoint_size_line(path: Path, keep: int | None) -> str:
    """`checkpoint step_000010: 2.10 GB on disk; coordinator.keep_checkpoints 2 keeps ~4.20 GB`."""
    size = checkpoint_bytes(path)
    kept = (f"coordinator.keep_checkpoints {keep} keeps ~{_size(keep * size)}" if keep is not None else
            "coordinator.keep_checkpoints null keeps every one")
    return f"checkpoint {Path(path).name}: {_size(size)} on disk; {kept}"


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _note_failures(summary: RunSummary, tracker, step: int, tally: tuple[int, int, dict[str, int]]) -> None:
    """Count a step's failed samples into the summary; one console line when any failed."""
    failed, total, reasons = tally
    summary.failed_samples += failed
    summary.samples += total
    line = failure_line(step, failed, total, reasons)
    if line is not None:
        tracker.note(line)


def _record_eval(summary: RunSummary, step: int, m: dict[str, float]) -> None:
    summary.eval_history.append((step, m["eval/reward"]))
    if m.get("eval/failed"):
        summary.eval_failed[step] = int(m["eval/failed"])


def _apply_control(coord: Coordinator, control, metrics: dict, rescale_trainer=None, refused=None) -> None:
    """Apply requests from `gspo-ray scale ...` between steps, answer each (applied, or refused with the reason
    resize_pool returns) and report progress back. `rescale_trainer(n)` resizes the trainer pool (checkpoint,
    rebuild, reload: TrainerRecovery.rescale) and returns a recovery.Resize. refused: the TrainerRecovery whose
    `scale_refused` (the last refused resize and why) the report carries."""
    import ray

    requests = ray.get(control.take_requests.remote())
    for key, size in requests.items():
        applied, reason, m = resize_pool(coord, key, size, rescale_trainer)
        metrics.update(m)
        pool = coord.rollout if key == "rollout_workers" else coord.trainer
        control.answer.remote(key, applied, reason, pool.num_workers)
    metrics["trainer/workers"] = coord.trainer.num_workers
    status = {"step": coord.state.step, "version": coord.state.version, "rollout_workers": coord.rollout.num_workers,
              "trainer_workers": coord.trainer.num_workers}
    if refused is not None and refused.scale_refused is not None:
        status["trainer_scale_refused"] = dict(refused.scale_refused)
    control.report.remote(status)


def write_rollouts(path: Path, groups) -> None:
    """One JSON line per trained sample: ids, engine log-probs, per-token versions, reward, worker."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for g in groups:
            for i, s in enumerate(g.samples):
                f.write(json.dumps({"uid": g.uid, "sample": s.sample_index, "worker": s.worker_id,
                                    "prompt_ids": s.prompt_ids, "completion_ids": s.completion_ids,
                                    "logprobs": s.logprobs, "versions": s.versions, "loss_mask": s.loss_mask,
                                    "segments": s.segments, "reward": s.reward,
                                    "advantage": g.advantages[i] if g.advantages else None,
                                    "finish_reason": s.finish_reason}) + "\n")


