"""The job's own check of the engine's log-probs as GSPO's anchor (Coordinator.train_on): the trainer scores the
first mini-batch's samples of its current version before the step's first update; a fixed band that cannot hold the
gap stops the run with nothing trained, eps auto keeps its band above the gap's floor; async batches of an older
version are not compared. A scripted trainer stands in for the pool (no engine, no Ray)."""
import importlib

import pytest
import torch
import typer

from gspo_ray.config import load_config
from gspo_ray.coordinator.loop import AnchorGapTooWide, Coordinator, LoopState
from gspo_ray.data.records import Group, Prompt, Sample
from gspo_ray.preflight.job import anchor_line
from gspo_ray.preflight.report import PreflightReport


class GapTrainer:
    """The trainer's log-probs are the engine's plus `gap` on row 0 and minus `gap` on row 1 of what it is asked
    (per sequence s = +gap, -gap: rms = gap)."""

    def __init__(self, gap: float):
        self.gap, self.asked, self.trained = gap, [], []

    def compute_logprobs(self, batch, purpose="old_logprobs"):
        self.asked.append((purpose, batch.num_sequences))
        sign = [1.0 if i % 2 == 0 else -1.0 for i in range(batch.num_sequences)]
        return batch.old_logp + self.gap * batch.loss_mask * torch.tensor(sign)[:, None]

    def train_step(self, batch, eps=None):
        self.trained.append(eps)
        # what eps auto reads of a reuse mini-batch: no drift
        return {"train/policy_version": float(len(self.trained)), "train/logr_mean": 0.0, "train/logr_sq_mean": 0.0,
                "train/n_tokens": 4.0, "train/n_seqs": 2.0, "train/clip_frac_seq": 0.0}

    def end_batch(self):
        pass


def _groups(version: int, n: int = 2):
    out = []
    for g in range(n):
        samples = [Sample(prompt_uid=f"p{g}", sample_index=i, prompt_ids=[5, 6], completion_ids=[9, 9],
                          logprobs=[-0.5, -0.25], loss_mask=[1, 1], versions=[version, version],
                          finish_reason="stop") for i in range(2)]
        out.append(Group(prompt=Prompt(uid=f"p{g}", prompt_ids=[5, 6]), samples=samples, advantages=[0.7, -0.7]))
    return out


def _coord(trainer, *overrides, state=None):
    cfg = load_config(None, ["coordinator.prompts_per_step=2", "coordinator.num_minibatches=2",
                             "coordinator.recompute_old_logprobs=false", *overrides])
    return Coordinator(cfg, None, trainer, None, state or LoopState())


def test_a_gap_the_fixed_band_cannot_hold_stops_before_any_update():
    trainer = GapTrainer(gap=0.012)  # the bf16/bf16 SmolLM2 measurement, per sequence
    coord = _coord(trainer, "algorithm.eps=fixed")
    with pytest.raises(AnchorGapTooWide, match=r"step 1: .*0\.012 rms per sequence.*clip band 0\.0003/0\.0004.*"
                                               r"nothing was trained.*algorithm\.eps: auto"):
        coord.train_on(_groups(version=0))
    assert trainer.trained == [] and trainer.asked == [("anchor_gap", 2)]  # one mini-batch of 2 samples scored


def test_a_gap_within_a_third_of_the_band_trains_and_is_logged():
    trainer = GapTrainer(gap=0.9e-4)  # floor 2.7e-4 <= 3e-4
    coord = _coord(trainer, "algorithm.eps=fixed")
    out = coord.train_on(_groups(version=0))
    assert len(trainer.trained) == 2 and out["train/anchor_gap_samples"] == 2.0
    assert out["train/anchor_gap_seq_std"] == pytest.approx(0.9e-4, rel=1e-2)
    assert out["train/anchor_gap_outside_band"] == 0.0
    assert out["time/old_logprobs_s"] == 0.0  # the engine's anchor: no old-policy forward
    # step 2 of the default schedule (1, 11, 21, ...) scores nothing
    coord.state.step = 1
    coord.train_on(_groups(version=coord.state.version))
    assert len(trainer.asked) == 1
    coord.state.step = 10  # step 11
    coord.train_on(_groups(version=coord.state.version))
    assert len(trainer.asked) == 2


def test_eps_auto_keeps_its_band_above_the_gaps_floor():
    trainer = GapTrainer(gap=0.012)
    coord = _coord(trainer, "algorithm.eps=auto")
    out = coord.train_on(_groups(version=0))
    # floor = 3 x 0.012: the first update already trains with it, and auto never narrows below it
    assert out["train/anchor_gap_band_floor"] == pytest.approx(0.036, rel=1e-2)
    assert trainer.trained[0][0] == pytest.approx(0.036, rel=1e-2)
    assert coord.auto_eps.min_eps == pytest.approx(0.036, rel=1e-2)
    assert out["train/anchor_gap_outside_band"] == 0.0  # within the band now in force
    # a gap auto's max_eps (0.2) cannot hold: stopped, and auto is not offered as the way out
    with pytest.raises(AnchorGapTooWide, match=r"eps auto would need eps_low >= 0\.24, above .*max_eps 0\.2"):
        _coord(GapTrainer(gap=0.08), "algorithm.eps=auto").train_on(_groups(version=0))


def test_async_samples_of_an_older_version_are_not_compared():
    trainer = GapTrainer(gap=0.5)  # would stop any band
    coord = _coord(trainer, "coordinator.mode=async", "algorithm.eps=fixed", state=LoopState(version=3))
    out = coord.train_on(_groups(version=2))  # sampled one update before the trainer's version
    assert out["train/anchor_gap_samples"] == 0.0 and "train/anchor_gap_seq_std" not in out
    assert trainer.asked == [] and len(trainer.trained) == 2


def test_the_recomputed_anchor_is_not_checked():
    trainer = GapTrainer(gap=0.5)
    coord = _coord(trainer, "coordinator.recompute_old_logprobs=true", "algorithm.eps=fixed",
                   "coordinator.mode=sync")
    out = coord.train_on(_groups(version=0))
    assert "train/anchor_gap_samples" not in out and [p for p, _ in trainer.asked] == ["old_logprobs"]
    # the old-policy forward's seconds, part of the train phase's (benchmarks compare the two anchors by them)
    assert 0.0 < out["time/old_logprobs_s"] <= out["time/train_s"]


def test_the_cli_stops_with_the_one_line_and_exit_2(monkeypatch, capsys):
    import gspo_ray.coordinator.job as job
    import gspo_ray.coordinator.run_dir as run_dir

    def stopped(cfg, **kw):
        raise AnchorGapTooWide("step 1: the engine's log-probs are ... Ways out: ...")

    main = importlib.import_module("gspo_ray.cli.main")  # the module (gspo_ray.cli.main is also a function)
    monkeypatch.setattr(run_dir, "check_run_dir", lambda cfg, **kw: None)
    monkeypatch.setattr(main, "_preflight", lambda cfg, **kw: None)
    monkeypatch.setattr(job, "run_job", stopped)
    with pytest.raises(typer.Exit) as e:
        main._train(load_config(None, []), resume=False, fresh=False, stop=None)
    assert e.value.exit_code == 2
    assert capsys.readouterr().err == "error: step 1: the engine's log-probs are ... Ways out: ...\n"


def test_the_preflight_says_which_anchor():
    report = PreflightReport()
    report.add("anchor", "ok", anchor_line(False, 10))
    assert report.summary().splitlines()[1] == ("anchor: the engine's log-probs, gap to the trainer's checked at step "
                                                "1 and every 10 steps (coordinator.anchor_gap_every)")
    assert anchor_line(False, 0).startswith("the engine's log-probs, gap to the trainer's checked at step 1 (")
    assert anchor_line(True, 10).startswith("recomputed by the trainer")
