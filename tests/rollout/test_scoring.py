"""RewardRunner on hand-made samples: decoding up to EOS, failure isolation, timeouts, plug-in resolution.
Calls run in child processes (the default) unless a test needs the thread backend's shared memory."""
import math
import os
import re
import threading
import time

import pytest

from gspo_ray.config import RewardConfig
from gspo_ray.data.records import Prompt, Sample
from gspo_ray.envs.rewards import copy_reward
from gspo_ray.models.tiny import build_tokenizer
from gspo_ray.envs.plugins import PluginError, resolve_callable, resolve_import_path
from gspo_ray.rollout.scoring import RewardRunner, check_reward

TIMEOUT = 0.5
HANG_TIMEOUT = 1.2  # long enough that a trivial call never overruns it on a busy machine


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _sample(tok, uid, completion, idx=0, eos=True, finish=None, tail=()):
    ids = _ids(tok, completion) + ([tok.eos_token_id] if eos else []) + list(tail)
    n = len(ids)
    return Sample(prompt_uid=uid, sample_index=idx, prompt_ids=_ids(tok, f"copy:{uid}="), completion_ids=ids,
                  logprobs=[0.0] * n, loss_mask=[1] * n, versions=[0] * n,
                  finish_reason=finish or ("stop" if eos else "length"))


def _prompts(*refs):
    return {r: Prompt(uid=r, prompt_ids=[], reference=r, text=f"copy:{r}=") for r in refs}


def test_copy_reward_by_import_path_scores_stopping(tok):
    samples = [
        _sample(tok, "4821", "4821"),                                   # exact + EOS: 5/5 + 1 = 2.0
        _sample(tok, "4821", "4821", idx=1, eos=False),                 # no EOS: 4/5 = 0.8
        _sample(tok, "4821", "48", idx=2, tail=_ids(tok, "21")),        # text after EOS is ignored: "48" -> 2/5
        _sample(tok, "4821", "", idx=3, eos=False, tail=[tok.pad_token_id] * 4),  # padding: "<pad>"x4 -> 0
    ]
    with RewardRunner("gspo_ray.envs.rewards:copy_reward", tok, timeout_s=TIMEOUT) as runner:
        metrics = runner.score(samples, _prompts("4821"))
    assert [s.reward for s in samples] == pytest.approx([2.0, 0.8, 0.4, 0.0])
    assert samples[0].reward_info == {"char_acc": 1.0, "exact": 1.0, "stopped": 1.0}
    assert all(s.failed is None for s in samples) and metrics["reward/num_failed"] == 0.0


def test_decode_keeps_specials_and_cuts_at_any_eos(tok):
    runner = RewardRunner(copy_reward, tok, eos_token_ids=[tok.eos_token_id, tok.bos_token_id])
    try:
        pad, eos, bos = tok.pad_token_id, tok.eos_token_id, tok.bos_token_id
        assert runner.decode(_ids(tok, "12") + [pad, eos, 5]) == ("12<pad>", True)
        assert runner.decode(_ids(tok, "12") + [bos, eos]) == ("12", True)   # a second stop id counts too
        assert runner.decode(_ids(tok, "12")) == ("12", False)
    finally:
        runner.close()


def test_failing_and_hanging_rewards_fail_only_their_samples(tok):
    release = threading.Event()

    def flaky(completion, reference, *, eos_found):
        if reference == "13":
            raise ValueError("bad reference 13")
        if reference == "99":
            release.wait(30)  # hangs well past the timeout; released at the end of the test
        return copy_reward(completion, reference, eos_found=eos_found)

    refs = ["11", "13", "99", "12", "99", "14", "15", "16"]
    samples = [_sample(tok, r, r, idx=i) for i, r in enumerate(refs)]
    runner = RewardRunner(flaky, tok, timeout_s=HANG_TIMEOUT, num_procs=2, isolation="thread")
    try:
        start = time.monotonic()
        metrics = runner.score(samples, _prompts(*refs))
        elapsed = time.monotonic() - start
        # Both hung calls are abandoned at their own deadline and replaced, so the batch is not held up:
        # ~1-3 s in all, not the 30 s the calls hang (the bound leaves room for a loaded 2-core machine).
        assert elapsed < 15
        by_ref = {s.prompt_uid: s for s in samples}
        assert re.fullmatch(r"reward raised ValueError at test_scoring\.py:\d+: bad reference 13", by_ref["13"].failed)
        assert by_ref["13"].reward is None
        hung = [s for s in samples if s.prompt_uid == "99"]
        assert all(s.failed == "reward timed out after 1.2s" and s.reward is None for s in hung)
        assert [s.reward for s in samples if s.prompt_uid not in ("13", "99")] == [2.0] * 5
        assert metrics["reward/num_failed"] == 3 and metrics["reward/num_timeouts"] == 2
        assert metrics["reward/abandoned_threads"] == 2
        # The pool still has its full capacity for the next batch.
        more = [_sample(tok, "11", "11", idx=i) for i in range(4)]
        runner.score(more, _prompts("11"))
        assert [s.reward for s in more] == [2.0] * 4
    finally:
        release.set()
        runner.close()
    deadline = time.monotonic() + 5
    while runner._backend.pool.abandoned_alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner._backend.pool.abandoned_alive == 0  # released threads exit instead of rejoining the pool


RUNAWAY = '''
import os


def runaway(completion, reference, *, pid_dir):
    """Scores exact copies 1.0, except reference '99': records its pid, then spins on the CPU forever."""
    if reference == "99":
        with open(os.path.join(pid_dir, f"{os.getpid()}.pid"), "w"):
            pass
        while True:
            pass
    if reference == "13":
        raise ValueError("bad reference 13")
    return float(completion == reference)
'''


def test_runaway_reward_process_is_killed_and_replaced(tok, tmp_path, monkeypatch):
    (tmp_path / "runaway_reward.py").write_text(RUNAWAY)   # a light module: children start fast
    monkeypatch.syspath_prepend(str(tmp_path))
    refs = ["11", "99", "13", "12", "14", "15"]
    samples = [_sample(tok, r, r, idx=i) for i, r in enumerate(refs)]
    runner = RewardRunner("runaway_reward:runaway", tok, timeout_s=HANG_TIMEOUT, num_procs=2,
                          fn_kwargs={"pid_dir": str(tmp_path)})
    try:
        runner.score([_sample(tok, "11", "11", idx=i) for i in range(2)], _prompts("11"))  # both children up
        start = time.monotonic()
        metrics = runner.score(samples, _prompts(*refs))
        assert time.monotonic() - start < 15   # not forever: the others are served by the other child
        by_ref = {s.prompt_uid: s for s in samples}
        assert by_ref["99"].failed == "reward timed out after 1.2s" and by_ref["99"].reward is None
        assert by_ref["13"].failed == "reward raised ValueError at runaway_reward.py:13: bad reference 13"
        assert [s.reward for s in samples if s.prompt_uid not in ("13", "99")] == [1.0] * 4
        assert metrics["reward/num_timeouts"] == 1 and metrics["reward/killed_procs"] == 1
        (pid_file,) = tmp_path.glob("*.pid")
        pid = int(pid_file.stem)
        assert pid not in runner._backend.pool.pids and not os.path.exists(f"/proc/{pid}")  # killed and reaped
        more = [_sample(tok, "11", "11", idx=i) for i in range(4)]  # full capacity again for the next batch
        assert runner.score(more, _prompts("11"))["reward/killed_procs"] == 0
        assert [s.reward for s in more] == [1.0] * 4
    finally:
        runner.close()


@pytest.mark.parametrize("value, reason", [
    (None, "reward returned NoneType, expected a finite float or a dict with 'reward'"),
    (math.nan, "reward returned nan, expected a finite float"),
    ("1.0", "reward returned str"),
    ({"score": 1.0}, "reward returned a dict without 'reward' (keys: score)"),
    ({"reward": 1.0, "note": "ok"}, "reward component 'note' is str, expected a number"),
    ({"reward": 1.0, "token_rewards": [0.5]}, "reward returned 1 token_rewards for 3 tokens"),
])
def test_malformed_returns_fail_with_reason(tok, value, reason):
    samples = [_sample(tok, "12", "12")]  # 3 completion tokens: '1', '2', EOS
    with RewardRunner(lambda c, r: value, tok, timeout_s=TIMEOUT) as runner:
        runner.score(samples, _prompts("12"))
    assert samples[0].reward is None and samples[0].failed.startswith(reason)


def test_dict_components_and_token_rewards(tok):
    def fn(completion, reference, **kw):
        return {"reward": True, "len": len(completion), "token_rewards": [0.0, 0.5, 1.0]}

    s = _sample(tok, "12", "12")
    with RewardRunner(fn, tok) as runner:
        runner.score([s], _prompts("12"))
    assert (s.reward, s.reward_info, s.token_rewards) == (1.0, {"len": 2.0}, [0.0, 0.5, 1.0])


def test_missing_prompt_and_already_failed(tok):
    lost, aborted = _sample(tok, "77", "77"), _sample(tok, "12", "12", idx=1)
    aborted.failed = "rollout worker died"
    with RewardRunner(copy_reward, tok) as runner:
        runner.score([lost, aborted], _prompts("12"))
    assert lost.failed == "no prompt with uid '77' to score against" and lost.reward is None
    assert aborted.failed == "rollout worker died" and aborted.reward is None


def test_only_declared_context_is_passed(tok):
    seen = {}

    def two_args(completion, reference):
        return float(completion == reference)

    def picky(completion, reference, *, finish_reason, meta, scale=1.0):
        seen.update(finish_reason=finish_reason, meta=meta, scale=scale)
        return scale

    def everything(completion, reference, **kwargs):
        seen.update(kwargs)
        return 0.0

    prompts = {"12": Prompt(uid="12", prompt_ids=[], reference="12", text="copy:12=", meta={"fields": {"a": 1}})}
    for fn, kwargs in ((two_args, {}), (picky, {"scale": 3.0}), (everything, {"x": 1})):
        s = _sample(tok, "12", "12", eos=False)
        with RewardRunner(fn, tok, fn_kwargs=kwargs, isolation="thread") as runner:  # `seen` is shared memory
            runner.score([s], prompts)
        assert s.failed is None
    assert seen["scale"] == 3.0 and seen["finish_reason"] == "length" and seen["x"] == 1
    assert seen["eos_found"] is False and seen["prompt_text"] == "copy:12=" and seen["meta"] == {"fields": {"a": 1}}
    assert seen["completion_ids"] == _ids(tok, "12")


def test_signature_errors_name_the_field(tok):
    with pytest.raises(PluginError, match=r"reward\.kwargs may not set \['eos_found'\]"):
        RewardRunner(copy_reward, tok, fn_kwargs={"eos_found": True})
    with pytest.raises(PluginError, match=r"reward\.kwargs: 'two' takes no argument\(s\) \['typo'\]"):
        RewardRunner(two, tok, fn_kwargs={"typo": 1})
    with pytest.raises(PluginError, match=r"reward\.fn: 'one' must take \(completion, reference\)"):
        RewardRunner(one, tok)
    with pytest.raises(PluginError, match=r"reward\.kwargs: 'needs' requires \['key'\]"):
        RewardRunner(needs, tok)
    with pytest.raises(ValueError, match="timeout_s > 0"):
        RewardRunner(copy_reward, tok, timeout_s=0)
    # The same checks as a pre-flight, with no tokenizer or threads.
    assert check_reward("gspo_ray.envs.rewards:cer_reward", {"hotwords": ["x"], "floor": -1.0}).__name__ == "cer_reward"
    with pytest.raises(PluginError, match=r"reward\.kwargs: 'two' takes no argument\(s\) \['floor'\]"):
        check_reward(two, {"floor": 0.0})


def two(completion, reference):
    return 0.0


def one(completion):
    return 0.0


def needs(completion, reference, *, key):
    return 0.0


def test_import_paths(tmp_path, monkeypatch):
    assert resolve_import_path("gspo_ray.envs.rewards:copy_reward") is copy_reward
    assert resolve_import_path("gspo_ray.envs.rewards.copy_reward") is copy_reward        # dotted form
    assert resolve_import_path("gspo_ray.envs.rewards:copy_reward.__name__") == "copy_reward"
    with pytest.raises(PluginError, match=r"reward\.fn: 'gspo_ray\.envs\.rewards' has no attribute 'copy'"):
        resolve_import_path("gspo_ray.envs.rewards:copy", "reward.fn")
    with pytest.raises(PluginError, match=r"reward\.fn: no module named 'no_such_pkg'"):
        resolve_import_path("no_such_pkg.rewards:fn", "reward.fn")
    with pytest.raises(PluginError, match=r"reward\.fn: no module named 'no_such_pkg'"):
        resolve_import_path("no_such_pkg.rewards.fn", "reward.fn")
    with pytest.raises(PluginError, match=r"reward\.fn: 'nodots' names no module"):
        resolve_import_path("nodots", "reward.fn")
    with pytest.raises(PluginError, match=r"reward\.fn: 'gspo_ray\.data\.tasks:TASKS' resolved to a tuple"):
        resolve_callable("gspo_ray.data.tasks:TASKS", "reward.fn")
    # A user module whose own import fails is reported as such, not as "no module named my_reward".
    (tmp_path / "my_reward.py").write_text("import not_installed_dep\ndef fn(c, r):\n    return 1.0\n")
    (tmp_path / "good_reward.py").write_text("def fn(c, r):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=r"importing module 'my_reward' .* failed: ModuleNotFoundError: "
                                         r"No module named 'not_installed_dep'"):
        resolve_import_path("my_reward.fn", "reward.fn")
    assert resolve_callable("good_reward:fn")("a", "b") == 1.0


def test_score_async_and_from_config(tok):
    cfg = RewardConfig(fn="gspo_ray.envs.rewards:copy_reward", kwargs={"bonus": 0.5}, timeout_s=1.0)
    with RewardRunner.from_config(cfg, tok) as runner:
        samples = [_sample(tok, "12", "12", idx=i) for i in range(16)]
        future = runner.score_async(samples, _prompts("12"))
        metrics = future.result(timeout=10)
        assert [s.reward for s in samples] == [1.5] * 16 and metrics["reward/num_failed"] == 0.0


WORDY = '''
def wordy(completion, reference):
    raise ValueError(f"cannot read {completion!r}: {len(completion)} characters, expected {len(reference)}")
'''


def test_differently_worded_errors_from_one_line_are_one_group(tok, tmp_path, monkeypatch):
    """20 messages from one line of a reward in its real child process: one group, named by type and frame."""
    from gspo_ray.coordinator.failures import count_reason

    (tmp_path / "wordy_reward.py").write_text(WORDY)
    monkeypatch.syspath_prepend(str(tmp_path))
    samples = [_sample(tok, "4821", "1" * n, idx=n) for n in range(1, 21)]
    with RewardRunner("wordy_reward:wordy", tok, timeout_s=HANG_TIMEOUT, num_procs=1) as runner:
        runner.score(samples, _prompts("4821"))
    assert len({s.failed for s in samples}) == 20  # every message differs
    reasons = {}
    for s in samples:
        count_reason(reasons, s.failed)
    assert reasons == {"reward raised ValueError at wordy_reward.py:3: cannot read '1': 1 characters, expected 4": 20}
