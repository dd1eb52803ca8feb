"""Prompt sources: token ids made once, stable unique uids, seeded epochs, and early errors naming file:line."""
import json

import pytest

from gspo_ray.config import DataConfig
from gspo_ray.data.prompts import PromptSource
from gspo_ray.data.sources import DataRowsError
from gspo_ray.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_builtin_prompts_are_char_tokens_without_specials(tok_dir, tok):
    src = PromptSource.from_task("copy", tok_dir, num_train=40, num_eval=8, seed=0, min_digits=2, max_digits=3)
    p = src.take(1)[0]
    assert p.text.startswith("copy:") and p.text == f"copy:{p.reference}="
    assert p.prompt_ids == [tok.convert_tokens_to_ids(c) for c in p.text]       # one id per char, no BOS/EOS
    assert tok.bos_token_id not in p.prompt_ids and tok.eos_token_id not in p.prompt_ids
    assert p.uid == f"train-{p.meta['index']}-e0" and p.meta["origin"] == f"builtin:copy/train#{p.meta['index']}"


def test_epochs_reshuffle_with_unique_uids_and_resume(tok):
    src = PromptSource.from_task("copy", tok, num_train=20, num_eval=4, seed=3, min_digits=2, max_digits=2)
    first, second = src.take(20), src.take(20)
    assert second[0].meta["epoch"] == 1 and src.epoch == 1 and src.take(1)[0].meta["epoch"] == 2
    assert sorted(p.text for p in first) == sorted(p.text for p in second)   # the same 20 rows each epoch...
    assert [p.text for p in first] != [p.text for p in second]               # ...in a new order
    uids = [p.uid for p in first + second]
    assert len(set(uids)) == 40                                              # unique within the job
    # Same seed -> same order; the cursor survives a checkpoint.
    again = PromptSource.from_task("copy", tok, num_train=20, num_eval=4, seed=3, min_digits=2, max_digits=2)
    assert [p.uid for p in again.take(25)] == uids[:25]
    state = again.state_dict()
    assert state == {"epoch": 1, "position": 5, "num_rows": 20}
    resumed = PromptSource.from_task("copy", tok, num_train=20, num_eval=4, seed=3, min_digits=2, max_digits=2)
    resumed.load_state_dict(state)
    assert [p.uid for p in resumed.take(5)] == [p.uid for p in again.take(5)]
    with pytest.raises(ValueError, match="checkpoint was taken with 20 prompts"):
        PromptSource.from_task("copy", tok, num_train=10, num_eval=4, seed=3, min_digits=2,
                               max_digits=2).load_state_dict(state)


def test_eval_split_is_ordered_fixed_and_disjoint(tok):
    kw = dict(num_train=200, num_eval=16, seed=0, min_digits=1, max_digits=3)
    held_out = PromptSource.from_task("add", tok, split="eval", **kw)
    rows = held_out.prompts()
    assert [p.uid for p in rows] == [f"eval-{i}-e0" for i in range(16)]
    assert [p.text for p in held_out.take(16)] == [p.text for p in rows]      # eval is not shuffled
    train = PromptSource.from_task("add", tok, split="train", **kw)
    assert not {p.text for p in train.prompts()} & {p.text for p in rows}


def test_jsonl_fields_and_meta(tmp_path, tok):
    path = _write_jsonl(tmp_path / "train.jsonl", [
        {"question": "copy:12=", "answer": "12", "hotwords": ["12"]},
        "",                                                                   # blank lines are skipped
        {"question": "3+4=", "answer": "7"},
    ])
    src = PromptSource.from_jsonl(path, tok, prompt_field="question", reference_field="answer", shuffle=False)
    a, b = src.take(2)
    assert (a.text, a.reference, b.reference) == ("copy:12=", "12", "7")
    assert a.meta["fields"] == {"hotwords": ["12"]} and a.meta["origin"] == f"{path}:1"
    assert b.meta["origin"] == f"{path}:3" and len(b.prompt_ids) == 4


def test_jsonl_errors_name_file_line_and_field(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        PromptSource.from_jsonl(tmp_path / "nope.jsonl", tok)
    path = _write_jsonl(tmp_path / "a.jsonl", [{"prompt": "1+1=", "reference": "2"}, {"prompt": "2+2="}])
    with pytest.raises(ValueError, match=r"a\.jsonl:2: row has no field 'reference' \(data\.reference_field\)"):
        PromptSource.from_jsonl(path, tok)
    path = _write_jsonl(tmp_path / "b.jsonl", [{"text": "1+1=", "reference": "2"}])
    with pytest.raises(ValueError, match=r"b\.jsonl:1: row has no field 'prompt' \(data\.prompt_field\); "
                                         r"its fields: text, reference"):
        PromptSource.from_jsonl(path, tok)
    path = _write_jsonl(tmp_path / "c.jsonl", [{"prompt": "1+1=", "reference": "2"}, "{oops"])
    with pytest.raises(ValueError, match=r"c\.jsonl:2: not valid JSON"):
        PromptSource.from_jsonl(path, tok)
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": ["1+1="], "reference": "2"}])
    with pytest.raises(ValueError, match=r"d\.jsonl:1: field 'prompt' \(data\.prompt_field\) must be a string"):
        PromptSource.from_jsonl(path, tok)
    path = _write_jsonl(tmp_path / "e.jsonl", [{"prompt": [{"role": "user", "content": "1+1="}], "reference": 2}])
    with pytest.raises(ValueError, match=r"e\.jsonl:1: .*set data\.apply_chat_template: true"):
        PromptSource.from_jsonl(path, tok)


def test_length_checks_name_rows_and_counts(tmp_path, tok):
    rows = [{"prompt": "copy:1=", "reference": "1"}] * 3 + [{"prompt": "copy:" + "1" * 20 + "=", "reference": "x"}]
    path = _write_jsonl(tmp_path / "long.jsonl", rows)
    src = PromptSource.from_jsonl(path, tok, max_prompt_tokens=16)         # parsing alone is cheap and passes
    # validate() checks the whole file up front: the 4th row has 5 + 20 + 1 = 26 tokens.
    with pytest.raises(DataRowsError) as e:
        src.validate()
    assert e.value.lines() == [f"{path}:4: prompt has 26 tokens, out of bounds: at most 16 tokens fit "
                              "(max_prompt_tokens=16)"]
    # copy:1= is 7 tokens; max_model_len 16 - max_new_tokens 10 leaves 6: every row is too long, one line each.
    src = PromptSource.from_jsonl(path, tok, max_model_len=16, max_new_tokens=10)
    with pytest.raises(DataRowsError) as e:
        src.take(1)                                                            # iteration validates first
    why = "rollout.max_model_len=16 - rollout.max_new_tokens=10 = 6"
    assert e.value.lines() == [f"{path}:{i}: prompt has {n} tokens, out of bounds: at most 6 tokens fit ({why})"
                               for i, n in ((1, 7), (2, 7), (3, 7), (4, 26))]
    assert len(PromptSource.from_jsonl(path, tok, max_prompt_tokens=26).validate()) == 4


def test_past_ten_problems_are_counted(tmp_path, tok):
    """Every row is checked; the first ten problems are listed one per line, the rest counted."""
    path = _write_jsonl(tmp_path / "many.jsonl", [{"prompt": "", "reference": "1"}] * 13)
    with pytest.raises(DataRowsError) as e:
        PromptSource.from_jsonl(path, tok)
    assert e.value.total == 13 and len(e.value.lines()) == 11
    assert e.value.lines()[0] == f"{path}:1: field 'prompt' (data.prompt_field) is an empty string"
    assert e.value.lines()[-1] == "... and 3 more problem(s) like these"


def test_chat_template_is_rendered_once(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    path = _write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "copy:12", "reference": "12"}])
    with pytest.raises(ValueError, match="apply_chat_template is true but the tokenizer .* has no chat template"):
        PromptSource.from_jsonl(path, tok_dir, apply_chat_template=True).validate()
    chat_tok = AutoTokenizer.from_pretrained(tok_dir)
    # A toy template: the message, then '=' as the generation prompt, then the BOS token written out as text.
    chat_tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                              "{% if add_generation_prompt %}={% endif %}<bos>")
    p = PromptSource.from_jsonl(path, chat_tok, apply_chat_template=True).take(1)[0]
    assert p.text == "copy:12=<bos>"
    assert p.prompt_ids[-1] == chat_tok.bos_token_id and len(p.prompt_ids) == 9   # "<bos>" is one special token


def test_lost_characters_warn(tmp_path, tok):
    path = _write_jsonl(tmp_path / "space.jsonl", [{"prompt": "copy: 12=", "reference": "12"}])
    with pytest.warns(UserWarning, match=r"space\.jsonl:1: .*characters outside the tokenizer's vocabulary"):
        PromptSource.from_jsonl(path, tok).validate()


def test_from_config(tmp_path, tok):
    cfg = DataConfig(task="add", min_digits=1, max_digits=2, num_eval=8, seed=5)
    train = PromptSource.from_config(cfg, tok, num_train=50, max_model_len=64, max_new_tokens=8)
    held_out = PromptSource.from_config(cfg, tok, split="eval")
    assert len(train) == 50 and len(held_out) == 8
    assert train.name == "builtin:add/train" and held_out.take(1)[0].uid == "eval-0-e0"
    assert PromptSource.from_config(DataConfig(num_eval=0), tok, split="eval") is None
    path = _write_jsonl(tmp_path / "t.jsonl", [{"q": "1+1=", "a": "2"}])
    cfg = DataConfig(source="jsonl", path=path, prompt_field="q", reference_field="a")
    assert PromptSource.from_config(cfg, tok).take(1)[0].reference == "2"
    assert PromptSource.from_config(cfg, tok, split="eval") is None          # no eval_path


def test_guess_task_from_config(tok):
    from gspo_ray.config import JobConfig, MultiTurnConfig, RolloutConfig

    cfg = DataConfig(task="guess", guess_low=0, guess_high=9, num_eval=20, seed=2)
    train = PromptSource.from_config(cfg, tok, num_train=100, max_model_len=32, max_new_tokens=16)
    held_out = PromptSource.from_config(cfg, tok, split="eval")
    p = train.take(1)[0]
    assert p.text == "0-9:" and p.prompt_ids == [tok.convert_tokens_to_ids(c) for c in "0-9:"]
    assert 0 <= int(p.reference) <= 9 and train.name == "builtin:guess/train"
    refs = [q.reference for q in held_out.prompts()]
    assert sorted(refs) == sorted([str(s) for s in range(10)] * 2)                # every secret twice
    assert len({q.uid for q in train.take(150)}) == 150                       # uids stay unique across epochs
    with pytest.raises(ValueError, match="guess_low \\(5\\) > data.guess_high \\(2\\)"):
        DataConfig(task="guess", guess_low=5, guess_high=2)
    # The job must run the guessing game, over the same range.
    with pytest.raises(ValueError, match="data.task 'guess' is multi-turn: set rollout.multi_turn"):
        JobConfig(data=cfg)
    wrong = RolloutConfig(multi_turn=MultiTurnConfig(kwargs={"low": 0, "high": 99}))
    with pytest.raises(ValueError, match=r"guess_low/guess_high \(0-9\) must match .* low/high \(0-99\)"):
        JobConfig(data=cfg, rollout=wrong)
    assert JobConfig(data=cfg, rollout=RolloutConfig(multi_turn=MultiTurnConfig())).data.task == "guess"


def test_guess_recipe_loads_and_its_prompts_fit(tok):
    from pathlib import Path

    from gspo_ray.config import load_config

    recipe = Path(__file__).resolve().parents[2] / "gspo_ray" / "recipes" / "guess_moe.yaml"
    cfg = load_config(recipe)
    assert cfg.data.task == "guess" and cfg.rollout.multi_turn is not None
    limits = dict(max_new_tokens=cfg.rollout.max_new_tokens, max_model_len=cfg.rollout.max_model_len)
    held_out = PromptSource.from_config(cfg.data, tok, split="eval", **limits).validate()
    assert len(held_out) == cfg.data.num_eval
    assert PromptSource.from_config(cfg.data, tok, **limits).take(1)[0].text == "0-9:"
