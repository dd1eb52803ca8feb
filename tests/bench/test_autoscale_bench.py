"""`gspo-ray bench --suite autoscale` runs the job's own controller (coordinator/autoscale.py) on the phase-time
model, and its table holds what docs/autoscale.md reads: per scenario the best fixed split in hindsight, the step-0
split and the autoscaler. The claims themselves: within 10% of the best fixed split everywhere, at least 20%
above the step-0 split where that split loses 20% or more to the drift. Pure Python, a few seconds."""
from __future__ import annotations

from typer.testing import CliRunner

from gspo_ray.bench import autoscale
from gspo_ray.cli import app
from gspo_ray.coordinator import autoscale as controller

COLUMNS = ["scenario", "best fixed (engines/ranks)", "best fixed c/s", "step-0 (engines/ranks)", "step-0 c/s",
           "autoscaler c/s", "auto / best", "auto / step-0", "moves", "final (engines/ranks)"]


def test_the_suite_prints_the_table_from_the_real_controller(monkeypatch):
    decided = []
    real = controller.Autoscaler.decide

    def counted(self, *args):
        decided.append(1)
        return real(self, *args)

    monkeypatch.setattr(controller.Autoscaler, "decide", counted)  # observed, not replaced
    result = CliRunner().invoke(app, ["bench", "--suite", "autoscale"])
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if line.startswith("| scenario"))
    assert [c.strip() for c in header.strip("|").split("|")] == COLUMNS
    assert sum(line.startswith("| ") for line in result.output.splitlines()) == 1 + len(autoscale.SCENARIOS)
    assert len(decided) == sum(sc.steps for sc in autoscale.SCENARIOS)


def test_within_ten_per_cent_of_the_best_fixed_split_and_ahead_where_it_drifts():
    rows = autoscale.bench_rows()
    assert all(r["auto / best"] >= 0.9 for r in rows), rows
    drifting = [r for r in rows if r["best fixed c/s"] >= 1.2 * r["step-0 c/s"]]
    assert len(drifting) >= 2 and all(r["auto / step-0"] >= 1.2 for r in drifting), rows
