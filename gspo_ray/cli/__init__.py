"""The `gspo-ray` command: main.py (train, config, scale, bench), models.py, export_eval.py, jobs.py (submit,
status, logs, stop) over submission.py (the Ray Job Submission client), errors.py (one line per input error)."""
from gspo_ray.cli.main import app, main

__all__ = ["app", "main"]
