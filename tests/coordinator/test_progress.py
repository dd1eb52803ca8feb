"""The console during training: the progress bar's fields (failed only on a step where samples failed, the DP
imbalance only above 1.25) and lines written above it."""
from gspo_ray.coordinator.tracking import MetricsTracker


def test_failed_shows_in_the_bar_only_when_samples_failed_and_notes_go_to_stderr(tmp_path, capsys):
    clean = MetricsTracker(tmp_path / "a", total_steps=1, tensorboard=False, progress=True)
    clean.log(1, {"rollout/reward_mean": 0.5, "rollout/failed_samples": 0.0, "train/dp_imbalance": 1.2})
    clean.close()  # the bar's last state is printed on close
    first = capsys.readouterr().err
    failing = MetricsTracker(tmp_path / "b", total_steps=1, tensorboard=False, progress=True)
    failing.note("step 1: 3/128 samples failed (2%): 'reward raised KeyError at r.py:3: x' x3")
    failing.log(1, {"rollout/reward_mean": 0.25, "rollout/failed_samples": 3.0, "train/dp_imbalance": 1.6})
    failing.close()
    second = capsys.readouterr().err
    assert "R=0.5" in first and "failed=" not in first and "dp=" not in first
    assert "R=0.25" in second and "failed=3" in second and "dp=1.6" in second  # a rank waited on: shown
    assert "step 1: 3/128 samples failed (2%): 'reward raised KeyError at r.py:3: x' x3\n" in second


def test_notes_without_a_bar_are_plain_stderr_lines(tmp_path, capsys):
    tracker = MetricsTracker(tmp_path, total_steps=2, tensorboard=False, progress=False)
    tracker.note("checkpoint step_000001: 2.2 MB on disk; coordinator.keep_checkpoints 2 keeps ~4.5 MB")
    tracker.close()
    assert capsys.readouterr().err == ("checkpoint step_000001: 2.2 MB on disk; coordinator.keep_checkpoints 2 "
                                       "keeps ~4.5 MB\n")


def test_a_row_cut_short_by_a_kill_never_breaks_reading_trimming_or_resuming(tmp_path, caplog):
    """A kill mid-write leaves `{"step": 3, "rollout/rew` without its newline. Reading (plot, benches), the
    recovery's trim and a resumed run's appends must neither raise nor glue the next row onto the fragment."""
    import json

    from gspo_ray.coordinator.recovery import trim_metrics
    from gspo_ray.coordinator.tracking import read_metrics

    path = tmp_path / "metrics.jsonl"
    whole = "".join(json.dumps({"step": s, "rollout/reward_mean": s / 10}) + "\n" for s in (1, 2))
    path.write_text(whole + '{"step": 3, "rollout/rew')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    assert "metrics.jsonl:3: not a whole metrics row" in caplog.text
    trim_metrics(path, keep_through=5)  # in-job recovery: the fragment goes, the whole rows stay
    assert path.read_text() == whole
    path.write_text(whole + '{"step": 3, "rollout/rew')
    tracker = MetricsTracker(tmp_path, total_steps=4, start_step=2, tensorboard=False, progress=False)  # --resume
    tracker.log(3, {"rollout/reward_mean": 0.3})
    tracker.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]  # every line whole, the new row its own
    assert read_metrics(path)[-1]["rollout/reward_mean"] == 0.3
