"""Metrics out: JSONL (one line per step), TensorBoard event files, Weights & Biases (optional), a live progress bar,
and the final PNG plot."""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

# the progress bar's fields (docs/real-models.md explains them); "failed" only on a step where samples failed
PROGRESS_KEYS = {"eval/reward": "eval", "rollout/reward_mean": "R", "train/clip_frac_seq": "clip",
                 "train/kl": "kl", "rollout/tokens_per_s": "tok/s", "rollout/failed_samples": "failed",
                 "train/dp_imbalance": "dp"}
# fields shown only past a threshold: failed samples when there are any, the DP imbalance (the busiest trainer
# rank's forwarded tokens over the mean) when the step waits noticeably on one rank
PROGRESS_SHOWN_ABOVE = {"failed": 0.0, "dp": 1.25}


class MetricsTracker:
    """Appends each step's metrics to `metrics.jsonl`, mirrors them to TensorBoard, drives the progress bar."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int = 0, tensorboard: bool = True,
                 progress: bool = True, wandb=None, run_config: dict | None = None):
        """wandb: a `WandbConfig` (None or mode disabled = off); run_config is logged as the W&B run's config."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        drop_partial_row(self.path)  # a resumed run appends: never onto the fragment a kill left
        self._tb = None
        self._tb_dir = Path(run_dir) / "tensorboard"
        if tensorboard:  # a resumed run: events past the checkpoint's step are the dead run's, purged
            self._tb = self._tb_writer(purge_step=start_step + 1 if start_step else None)
        self._wandb = WandbSink(wandb, Path(run_dir), run_config) if wandb and wandb.mode != "disabled" else None
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)

    def _tb_writer(self, purge_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self._tb_dir), purge_step=purge_step)

    def rewind(self, step: int) -> None:
        """An in-job recovery went back to `step`: the steps after it are replayed. TensorBoard: a new event file
        whose purge marker drops the dead run's events from step + 1 on. metrics.jsonl is trimmed by the recovery;
        W&B needs nothing (its log step only grows, `step` is a field: the replayed rows come later)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = self._tb_writer(purge_step=step + 1)
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and v is not None:
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(step, row)
        if self._bar is not None:
            shown = {short: f"{metrics[k]:.3g}" for k, short in PROGRESS_KEYS.items()
                     if k in metrics and metrics[k] > PROGRESS_SHOWN_ABOVE.get(short, -math.inf)}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1 if advance else 0)

    def note(self, line: str) -> None:
        """One console line (stderr) that does not break the progress bar."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.close()


class WandbSink:
    """One W&B run per run directory: its id is kept in run_dir/wandb/run_id, so a resumed job continues the same
    W&B run. wandb is imported only here (an optional extra); offline mode writes under run_dir/wandb.

    W&B drops a `log(step=k)` below its last step, so after an in-job recovery or a `--resume` past the checkpoint
    the replayed steps would keep the dead run's values. Instead W&B's own step only grows (one per row) and the
    training step is the field `step`, the x-axis of every chart (`define_metric`): a replayed step's row comes
    after the dead one, and the last row of each `step` is metrics.jsonl's (rows carry `job/replayed`)."""

    def __init__(self, cfg, run_dir: Path, run_config: dict | None = None):
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError("logging.wandb is selected but the wandb package is not installed: pip install "
                               "'gspo-ray[wandb]', or set logging.wandb.mode: disabled") from e
        root = run_dir / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        id_file = root / "run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        # x_disable_meta: W&B otherwise records the command line (sys.argv), and `key=value` overrides can carry
        # secrets (cluster.runtime_env.env_vars.HF_TOKEN=...); the run's config is the redacted one (job.py)
        self._run = wandb.init(project=cfg.project, entity=cfg.entity, group=cfg.group, tags=list(cfg.tags),
                               mode=cfg.mode, dir=str(run_dir), id=run_id, resume="allow", name=run_dir.name,
                               config=run_config or {}, settings=wandb.Settings(x_disable_meta=True))
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def log(self, step: int, row: dict) -> None:
        self._run.log({**{k: v for k, v in row.items() if v is not None}, "step": step})

    def close(self) -> None:
        self._run.finish()


def _clean(v) -> float | None:
    v = float(v)
    return None if math.isnan(v) or math.isinf(v) else v


def metric_rows(path: Path) -> list[dict]:
    """Every readable row of a metrics.jsonl in file order. A line that is not a whole JSON object with a `step`
    (the row a kill cut short mid-write) is skipped with a warning naming file:line, never raised on."""
    out = []
    for n, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                out.append(row)
                continue
        except ValueError:
            pass
        log.warning("%s:%d: not a whole metrics row (a write cut short?), skipped: %.60r", path, n, line)
    return out


def read_metrics(path: Path) -> list[dict]:
    """All rows of a metrics.jsonl (a resumed run appends; later rows win for a repeated step)."""
    rows = {row["step"]: row for row in metric_rows(path)}
    return [rows[s] for s in sorted(rows)]


def drop_partial_row(path: Path) -> None:
    """Cut a last line without its newline (a kill mid-write) off the file, so the next appended row starts on
    a line of its own instead of being glued to the fragment."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        data = f.seek(0) or f.read()
        keep = data.rfind(b"\n") + 1
        log.warning("%s: dropped an unfinished last row (%d bytes, a write cut short)", path, len(data) - keep)
        f.truncate(keep)


PLOT_PANELS = [
    ("reward", ["rollout/reward_mean", "eval/reward"]),
    ("clip fraction", ["train/clip_frac_seq", "train/clip_frac_tok"]),
    ("router churn", ["moe/router_churn"]),
    ("engine-trainer log-prob mismatch", ["train/mismatch_tok_mean", "train/mismatch_seq_mean"]),
]


def plot_metrics(metrics_path: Path, out_png: Path) -> Path:
    """Reward, clip fraction, router churn and mismatch over steps, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, axes = plt.subplots(len(PLOT_PANELS), 1, figsize=(7, 2.4 * len(PLOT_PANELS)), sharex=True)
    for ax, (title, keys) in zip(axes, PLOT_PANELS):
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="." if key.startswith("eval/") else None, label=key)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
