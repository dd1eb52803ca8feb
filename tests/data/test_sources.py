"""Prompt rows from files in the layouts users bring: verl parquet (a file or shards), a TRL save_to_disk dataset,
dotted fields, every row checked and every problem one line naming file, row and field."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gspo_ray.data.prompts import PromptSource
from gspo_ray.data.sources import DataRowsError, get_field, read_rows

MSG = [{"role": "user", "content": "copy:12="}]


def verl_rows(n=3, start=0):
    """Rows as verl's data preprocessing writes them (examples/data_preprocess/gsm8k.py)."""
    return [{"data_source": "copy", "prompt": [{"role": "user", "content": f"copy:{i}="}], "ability": "copy",
             "reward_model": {"style": "rule", "ground_truth": str(i)},
             "extra_info": {"split": "train", "index": i}} for i in range(start, start + n)]


def write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_verl_parquet_dotted_reference_and_fields_as_they_are(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", verl_rows())
    rows = read_rows(path, "parquet", "prompt", "reward_model.ground_truth", apply_chat_template=True)
    assert [r.reference for r in rows] == ["0", "1", "2"]
    assert rows[1].prompt == [{"role": "user", "content": "copy:1="}] and rows[1].origin == f"{path} row 1"
    assert rows[1].fields == {"data_source": "copy", "ability": "copy", "extra_info": {"split": "train", "index": 1},
                              "reward_model": {"style": "rule", "ground_truth": "1"}}


def test_a_pandas_index_is_not_a_field(tmp_path):
    import pandas as pd

    pd.DataFrame(verl_rows(3)).iloc[[2, 0]].to_parquet(tmp_path / "shuffled.parquet")  # verl writes with pandas
    rows = read_rows(tmp_path / "shuffled.parquet", "parquet", "prompt", "reward_model.ground_truth", True)
    assert [r.reference for r in rows] == ["2", "0"] and "__index_level_0__" not in rows[0].fields


def test_a_directory_of_shards_is_read_in_order(tmp_path):
    write_parquet(tmp_path / "data" / "train-00001-of-00002.parquet", verl_rows(2, start=2))
    write_parquet(tmp_path / "data" / "train-00000-of-00002.parquet", verl_rows(2))
    rows = read_rows(tmp_path / "data", "parquet", "prompt", "reward_model.ground_truth", apply_chat_template=True)
    assert [r.reference for r in rows] == ["0", "1", "2", "3"]


def test_trl_save_to_disk_dataset(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"prompt": "copy:7=", "solution": "7", "level": 1},
                                {"prompt": "copy:8=", "solution": "8", "level": 2}]).save_to_disk(tmp_path / "ds")
    rows = read_rows(tmp_path / "ds", "hf_disk", "prompt", "solution")
    assert [(r.prompt, r.reference, r.fields) for r in rows] == [("copy:7=", "7", {"level": 1}),
                                                                 ("copy:8=", "8", {"level": 2})]
    assert rows[0].origin == f"{tmp_path / 'ds'} row 0"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "x"}])}).save_to_disk(tmp_path / "dd")
    with pytest.raises(ValueError, match=r"a DatasetDict \(splits train\); point data.path / data.eval_path at one "
                                         r"split's directory, e.g. .*dd/train$"):
        read_rows(tmp_path / "dd", "hf_disk")
    (tmp_path / "ds" / "data-00000-of-00001.arrow").write_bytes(b"truncated")  # a broken save_to_disk directory
    with pytest.raises(ValueError, match=r"ds: not a readable save_to_disk dataset \("):
        read_rows(tmp_path / "ds", "hf_disk")


def test_a_directory_that_is_neither_parquet_nor_save_to_disk(tmp_path):
    (tmp_path / "mess").mkdir()
    (tmp_path / "mess" / "notes.txt").write_text("hello")
    with pytest.raises(ValueError) as e:
        read_rows(tmp_path / "mess", "parquet")
    assert str(e.value) == (f"directory {tmp_path / 'mess'} is neither parquet shards nor a save_to_disk dataset: "
                            "data.source 'parquet' reads *.parquet shards")
    write_parquet(tmp_path / "pq" / "a.parquet", verl_rows(1))
    with pytest.raises(ValueError, match=r"data.source 'hf_disk' reads a save_to_disk dataset \(state.json \+ "
                                         r"\*.arrow\), and it holds parquet files \(data.source: parquet\)$"):
        read_rows(tmp_path / "pq", "hf_disk")
    (tmp_path / "broken.parquet").write_text("not parquet")
    with pytest.raises(DataRowsError, match=r"broken.parquet: not a readable parquet file"):
        read_rows(tmp_path / "broken.parquet", "parquet")


def test_a_missing_file_says_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        read_rows("data/train.parquet", "parquet")
    assert str(e.value) == ("file not found: data/train.parquet (relative paths resolve against the current "
                            f"directory; tried {tmp_path}/data/train.parquet)")


def test_sharegpt_rows_are_explained_in_one_line(tmp_path):
    path = tmp_path / "sharegpt.jsonl"
    path.write_text(json.dumps({"prompt": [{"from": "human", "value": "copy:1="}], "reference": "1"}) + "\n")
    with pytest.raises(DataRowsError) as e:
        read_rows(path, "jsonl", apply_chat_template=True)
    assert e.value.lines() == [
        f"{path}:1: field 'prompt' (data.prompt_field) message 0 has ShareGPT keys 'from'/'value'; chat messages "
        "need 'role'/'content' (rename them: from -> role with human -> user and gpt -> assistant, value -> content)"]


def test_every_bad_row_is_one_line_naming_file_row_and_field(tmp_path):
    rows = verl_rows(6)
    del rows[1]["reward_model"]["ground_truth"]                      # a dotted field missing in one row
    rows[2]["prompt"] = [{"role": "narrator", "content": "copy:2="}]  # an unknown role
    rows[3]["prompt"] = [{"role": "user", "content": ["copy:3="]}]    # non-string content
    rows[4]["prompt"] = "   "                                         # an empty prompt
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataRowsError) as e:
        read_rows(path, "jsonl", "prompt", "reward_model.ground_truth", apply_chat_template=True)
    assert e.value.lines() == [
        f"{path}:2: row has no field 'reward_model.ground_truth' (data.reference_field); its fields: data_source, "
        "prompt, ability, reward_model, extra_info",
        f"{path}:3: field 'prompt' (data.prompt_field) message 0 has role 'narrator'; valid: system, user, "
        "assistant, tool",
        f"{path}:4: field 'prompt' (data.prompt_field) message 0 has list content; chat content must be a string",
        f"{path}:5: field 'prompt' (data.prompt_field) is an empty string"]


def test_get_field_prefers_a_literal_dotted_key():
    row = {"a.b": 1, "a": {"b": 2, "c": {"d": 3}}}
    assert (get_field(row, "a.b"), get_field(row, "a.c.d")) == (1, 3)
    assert get_field(row, "a.x") is get_field(row, "z")  # the same "missing" marker


def test_system_prompt_goes_before_the_messages(tmp_path):
    from gspo_ray.models.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}{% endfor %}="
    rows = verl_rows(1)
    rows.append({**verl_rows(1)[0], "prompt": [{"role": "system", "content": "1"}, *MSG]})  # keeps its own
    path = write_parquet(tmp_path / "t.parquet", rows)
    src = PromptSource.from_files(path, tok, source="parquet", reference_field="reward_model.ground_truth",
                                  apply_chat_template=True, system_prompt="0", shuffle=False)
    assert [p.text for p in src.prompts()] == ["s:0u:copy:0==", "s:1u:copy:12=="]
