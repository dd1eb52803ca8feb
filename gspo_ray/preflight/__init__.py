"""Every check of a job's input before Ray or any engine starts: the job (job.py) runs the model and tokenizer
(job_model.py, model.py), data (data.py) and plug-in (plugins.py) checks; report.py holds what they report."""
from gspo_ray.preflight.job import run_preflight
from gspo_ray.preflight.model import PreflightError
from gspo_ray.preflight.report import PreflightReport, call_with_timeout, one_line

__all__ = ["PreflightError", "PreflightReport", "run_preflight", "call_with_timeout", "one_line"]
