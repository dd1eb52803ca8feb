"""The preflight reads every row of the configured files (JSONL, parquet, save_to_disk) before Ray starts: each bad row
is one `error:` line naming the field, the file and the row (the first ten, then a count), exit 2."""
import json
import time
from pathlib import Path

import pyarrow as pa
import pytest
import pyarrow.parquet as pq
import yaml
from typer.testing import CliRunner

from gspo_ray.cli import app
from gspo_ray.config import load_config
from gspo_ray.data import sources
from gspo_ray.preflight import PreflightError, run_preflight
from gspo_ray.preflight.data import parse_data
from gspo_ray.preflight.plugins import import_reward
from gspo_ray.preflight.references import check_references
from gspo_ray.preflight.verdicts import VERDICTS_FILE, DataVerdicts

MATH = "gspo_ray.envs.rewards:math_verify_reward"
COPY = "gspo_ray.envs.rewards:copy_reward"


def verl_row(i, source="copy", answer=None):
    return {"data_source": source, "prompt": f"copy:{i}=", "ability": "copy",
            "reward_model": {"style": "rule", "ground_truth": str(i) if answer is None else answer},
            "extra_info": {"index": i}}


def job(tmp: Path, rows, *, reward=COPY, fmt="parquet", data=None) -> Path:
    """A tiny-model job reading `rows` as verl-layout parquet (or JSONL) with the reference at a dotted path."""
    path = tmp / f"train.{fmt}"
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"name": "pf", "logging": {"out_dir": str(tmp / "runs")},
           "data": {"source": fmt, "path": str(path), "reference_field": "reward_model.ground_truth", **(data or {})},
           "rollout": {"max_new_tokens": 6, "max_model_len": 64, "reward": {"fn": reward}}}
    out = tmp / "job.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


def errors(job_path: Path) -> list[str]:
    result = CliRunner().invoke(app, ["config", "validate", str(job_path)])
    assert result.exit_code == 2 and "Traceback" not in result.output, (result.exit_code, result.output)
    return result.stderr.strip().splitlines()


def test_a_verl_parquet_file_passes_with_a_reward_per_data_source(tmp_path):
    rows = [verl_row(12), verl_row(7, source="gsm8k", answer="7")]
    cfg = load_config(job(tmp_path, rows, reward={"copy": COPY, "gsm8k": MATH}))
    report = run_preflight(cfg)
    assert any(c.name == "data/train" and "2 prompts" in c.detail for c in report.checks), report.lines()


def test_unmapped_data_sources_and_unparsable_references_name_their_rows(tmp_path):
    rows = [verl_row(1), verl_row(2, source="mystery"), verl_row(3, source="gsm8k", answer="eighteen"),
            verl_row(4, source="gsm8k")]
    path = tmp_path / "train.parquet"
    assert errors(job(tmp_path, rows, reward={"copy": COPY, "gsm8k": MATH})) == [
        f"error: data.path: {path} row 1: field 'data_source' is 'mystery', which rollout.reward.fn maps to no "
        "reward function (mapped: copy, gsm8k; '*' maps any other)",
        f"error: data.path: {path} row 2: field 'reward_model.ground_truth' (data.reference_field): math-verify "
        "cannot parse the reference 'eighteen'"]


def test_bad_rows_past_ten_are_counted(tmp_path):
    rows = [verl_row(i) for i in range(14)]
    for r in rows[1:]:
        del r["reward_model"]["ground_truth"]   # a dotted field missing in some rows
    lines = errors(job(tmp_path, rows))
    path = tmp_path / "train.parquet"
    assert len(lines) == 11 and lines[-1] == "error: ... and 3 more problem(s) like these"
    # parquet keeps one schema: the rows without the key hold a null there
    assert lines[0] == (f"error: data.path: {path} row 1: field 'reward_model.ground_truth' (data.reference_field) "
                        "is null in this row")


def test_prompts_too_long_are_one_line_each(tmp_path):
    rows = [verl_row(1), {**verl_row(2), "prompt": "copy:" + "9" * 70 + "="}]
    path = tmp_path / "train.parquet"
    assert errors(job(tmp_path, rows)) == [
        f"error: data.path: {path} row 1: prompt has 76 tokens, out of bounds: at most 58 tokens fit "
        "(rollout.max_model_len=64 - rollout.max_new_tokens=6 = 58)"]


def test_a_directory_that_is_neither_parquet_nor_save_to_disk(tmp_path):
    path = job(tmp_path, [verl_row(1)])
    (tmp_path / "mess").mkdir()
    (tmp_path / "mess" / "rows.csv").write_text("prompt\ncopy:1=\n")
    cfg = yaml.safe_load(path.read_text())
    cfg["data"]["path"] = str(tmp_path / "mess")
    path.write_text(yaml.safe_dump(cfg))
    assert errors(path) == [f"error: data.path: directory {tmp_path / 'mess'} is neither parquet shards nor a "
                            "save_to_disk dataset: data.source 'parquet' reads *.parquet shards"]


def test_sharegpt_messages_are_explained(tmp_path):
    rows = [{**verl_row(1), "prompt": [{"from": "human", "value": "copy:1="}]}]
    path = tmp_path / "train.jsonl"
    assert errors(job(tmp_path, rows, fmt="jsonl", data={"apply_chat_template": True})) == [
        f"error: data.path: {path}:1: field 'prompt' (data.prompt_field) message 0 has ShareGPT keys 'from'/'value'; "
        "chat messages need 'role'/'content' (rename them: from -> role with human -> user and gpt -> assistant, "
        "value -> content)"]


def test_a_missing_data_file_names_the_absolute_path_tried(tmp_path, monkeypatch):
    path = job(tmp_path, [verl_row(1)])
    cfg = yaml.safe_load(path.read_text())
    cfg["data"]["path"] = "data/train.parquet"
    path.write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)
    assert errors(path) == [f"error: {path}: data.path: file not found: data/train.parquet (relative paths resolve "
                            f"against the current directory; tried {tmp_path}/data/train.parquet)"]


def test_reward_fn_mapping_is_checked(tmp_path):
    path = job(tmp_path, [verl_row(1)], reward={})
    result = CliRunner().invoke(app, ["config", "validate", str(path)])
    assert result.exit_code == 2 and "rollout.reward.fn: an empty mapping" in result.stderr, result.output
    path = job(tmp_path, [verl_row(1)], reward={"copy": "gspo_ray.envs.rewards:no_such_reward"})
    lines = errors(path)
    assert len(lines) == 1 and lines[0].startswith("error: rollout.reward.fn.copy: 'gspo_ray.envs.rewards' has no "
                                                   "attribute 'no_such_reward'"), lines


# ---- reference checks at dataset scale: worker processes with a per-reference timeout, verdicts remembered ----
# A reward whose check stalls on the reference "slow" (as sympy may on odd input), refuses "bad", and appends every
# reference it sees to the file COUNT names: the worker processes import it by its module path like any plug-in.
PLUGIN = '''
import os, time

def reward(completion, reference, **kw):
    return float(completion == reference)

def check(reference):
    with open(os.environ["PF_REF_COUNT"], "a") as f:
        f.write(str(reference) + "\\n")
    if reference == "slow":
        time.sleep(60)
    return "not a usable reference" if reference == "bad" else None

reward.check_reference = check
'''


@pytest.fixture
def slow_reward(tmp_path, monkeypatch):
    (tmp_path / "pf_slow_ref.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    count = tmp_path / "seen.txt"
    monkeypatch.setenv("PF_REF_COUNT", str(count))
    return count


def test_a_stalled_reference_check_is_named_and_the_preflight_ends(tmp_path, slow_reward):
    rows = [verl_row(1), verl_row(2, answer="slow"), verl_row(3), verl_row(4, answer="bad"), verl_row(5)]
    path = job(tmp_path, rows, reward="pf_slow_ref:reward", data={"reference_check_timeout_s": 2.0})
    start = time.perf_counter()
    lines = errors(path)
    took = time.perf_counter() - start
    data = tmp_path / "train.parquet"
    assert lines == [
        f"error: data.path: {data} row 1: field 'reward_model.ground_truth' (data.reference_field): the reference "
        "check did not finish within 2 s (data.reference_check_timeout_s)",
        f"error: data.path: {data} row 3: field 'reward_model.ground_truth' (data.reference_field): not a usable "
        "reference"]
    assert took < 15, took  # the stalled check sleeps 60 s; tokenizer and model checks take the rest
    seen = slow_reward.read_text().split()
    # every reference checked; the stalled one once (its chunk's others go to a fresh worker, "1" again with them)
    assert set(seen) == {"1", "3", "5", "bad", "slow"} and seen.count("slow") == 1, seen


def test_checks_that_raise_or_kill_their_process_name_the_reference():
    def check(reference):
        if reference == "raise":
            raise ValueError("odd input")
        if reference == "exit":
            import os
            os._exit(7)
        return None

    items = [(0, r) for r in ["a", "raise", "b", "exit", "c", "a"]]
    found = check_references([check], items, timeout_s=5.0, workers=1)
    assert found == [None, "check_reference raised ValueError: odd input", None,
                     "the reference check ended its process (exit code 7)", None, None]


def test_a_file_that_passed_is_not_read_again_until_it_changes(tmp_path, slow_reward, monkeypatch):
    rows = [verl_row(i) for i in range(1, 4)]
    cfg = load_config(job(tmp_path, rows, reward="pf_slow_ref:reward"))
    reward = import_reward(cfg, 30.0)
    run_dir = tmp_path / "run"
    verdicts = DataVerdicts(run_dir)
    parse_data(cfg, reward, verdicts)
    assert not run_dir.exists()  # written once the whole preflight passed
    verdicts.save()
    assert sorted(slow_reward.read_text().split()) == ["1", "2", "3"] and (run_dir / VERDICTS_FILE).is_file()

    read = sources.read_rows

    def no_read(*args, **kw):
        raise AssertionError("read again")

    monkeypatch.setattr(sources, "read_rows", no_read)
    parse_data(cfg, reward, DataVerdicts(run_dir))  # the --resume: nothing read, nothing checked
    assert sorted(slow_reward.read_text().split()) == ["1", "2", "3"]

    monkeypatch.setattr(sources, "read_rows", read)
    job(tmp_path, rows + [verl_row(4, answer="bad")], reward="pf_slow_ref:reward")  # the same path, new content
    with pytest.raises(PreflightError, match="row 3: .*not a usable reference"):
        parse_data(cfg, reward, DataVerdicts(run_dir))
    with pytest.raises(PreflightError, match="row 3: .*not a usable reference"):  # a failure is never remembered
        parse_data(cfg, reward, DataVerdicts(run_dir))


def test_train_remembers_in_the_run_dir_and_validate_writes_nothing(tmp_path, slow_reward):
    cfg = load_config(job(tmp_path, [verl_row(1)], reward="pf_slow_ref:reward"))
    run_preflight(cfg)
    assert not (cfg.run_dir / VERDICTS_FILE).exists()
    run_preflight(cfg, remember_in=cfg.run_dir)
    assert (cfg.run_dir / VERDICTS_FILE).is_file()
    known = yaml.safe_load((cfg.run_dir / VERDICTS_FILE).read_text())
    assert [v["rows"] for v in known.values()] == [1]
