"""Failed samples in the buffer (drop / score, engine aborts) and the failed-share stop; async staleness bound."""
import pytest

from gspo_ray.config import JobConfig, RewardConfig
from gspo_ray.coordinator.buffer import GroupBuffer
from gspo_ray.coordinator.failures import (FailureGuard, FailurePolicy, TooManyFailedSamples, count_reason,
                                            failure_line, reason_group)
from gspo_ray.data.records import Group, Prompt, Sample


def _group(uid, rewards, failed=(), aborted=(), version=0):
    """rewards[i] None with i in `failed`: the reward raised; i in `aborted`: the engine stopped it unscored."""
    samples = []
    for i, r in enumerate(rewards):
        samples.append(Sample(prompt_uid=uid, sample_index=i, prompt_ids=[5, 6], completion_ids=[9, 9, 9],
                              logprobs=[-0.5] * 3, loss_mask=[1, 1, 0], versions=[version] * 3,
                              finish_reason="aborted" if i in aborted else "stop", reward=r,
                              failed=f"reward raised ValueError: bad output {i}" if i in failed else None))
    return Group(prompt=Prompt(uid=uid, prompt_ids=[5, 6]), samples=samples)


def test_engine_abort_outside_partial_is_a_failed_sample():
    # Before: sample 1 (finish_reason "aborted", reward None, failed None) reached torch.tensor -> TypeError.
    for policy in (FailurePolicy("drop"), FailurePolicy("score", -1.0)):
        buf = GroupBuffer(failure=policy)
        g = _group("a", [1.0, None, 0.0, 1.0], aborted={1})
        stats = buf.admit([g], current_version=0)
        assert stats.admitted == 1 and stats.failed_samples == 1 and stats.samples == 4
        assert [s.sample_index for s in buf.groups[0].samples] == [0, 2, 3]   # always dropped, even under score
        reason = next(iter(stats.failure_reasons))
        assert reason.startswith("no reward: the engine stopped the completion ('aborted')")


def test_score_keeps_failed_completions_in_their_group():
    # rewards 1, 0, <raised>, 1 with failure_reward -1: mean 0.25, std(ddof=1) = sqrt(2.75 / 3) = 0.95743
    # A = (R - 0.25) / (0.95743 + 1e-4): +0.78326, -0.26109, -1.30545, +0.78326
    buf = GroupBuffer(failure=FailurePolicy("score", -1.0))
    stats = buf.admit([_group("a", [1.0, 0.0, None, 1.0], failed={2})], current_version=0)
    g = buf.groups[0]
    assert stats.failed_samples == 1 and [s.sample_index for s in g.samples] == [0, 1, 2, 3]
    assert g.advantages == pytest.approx([0.78326, -0.26109, -1.30545, 0.78326], abs=1e-4)
    assert g.samples[2].reward == -1.0 and g.samples[2].failed.startswith("reward raised")
    assert stats.rewards == [1.0, 0.0, 1.0]          # reward_mean reports the function's own scores

    # drop: the same group without it -> rewards 1, 0, 1: mean 2/3, std 0.57735 -> +0.57725, -1.15450, +0.57725
    buf = GroupBuffer(failure=FailurePolicy("drop"))
    buf.admit([_group("a", [1.0, 0.0, None, 1.0], failed={2})], current_version=0)
    assert buf.groups[0].advantages == pytest.approx([0.57725, -1.15450, 0.57725], abs=1e-4)


def test_score_per_token_puts_the_failure_reward_on_the_last_model_token():
    s = _group("a", [None], failed={0}).samples[0]
    FailurePolicy("score", -2.0).apply([s], per_token=True)
    assert s.token_rewards == [0.0, -2.0, 0.0]         # loss_mask [1, 1, 0]: token 1 is the last model token


def test_guard_stops_on_a_wholly_failed_step_or_a_streak():
    guard = FailureGuard(max_failed_share=0.2, max_failed_steps=3)
    reasons = {"reward raised TypeError: unsupported operand": 100, "reward timed out after 5s": 28}
    with pytest.raises(TooManyFailedSamples, match=r"step 1: every sample failed \(128/128\); first reasons: "
                                                    r"'reward raised TypeError: unsupported operand' x100; "
                                                    r"'reward timed out after 5s' x28"):
        guard.check(1, 128, 128, reasons)
    guard = FailureGuard(max_failed_share=0.2, max_failed_steps=3)
    for step, failed in enumerate([40, 40, 10, 40, 40], start=1):  # 31%, 31%, 8% (streak reset), 31%, 31%
        guard.check(step, failed, 128, {"x": failed})
    with pytest.raises(TooManyFailedSamples, match=r"step 6: 31% of 128 samples failed, above "
                                                    r"rollout.reward.max_failed_share \(0.2\) for 3 steps in a row"):
        guard.check(6, 40, 128, {"x": 40})


def test_failure_config_needs_a_failure_reward_under_score():
    with pytest.raises(ValueError, match="on_failure 'score' needs rollout.reward.failure_reward"):
        RewardConfig(on_failure="score")
    assert RewardConfig(on_failure="score", failure_reward=-1.0).failure_reward == -1.0


def test_async_staleness_counts_policy_updates_not_optimizer_steps():
    # 2 passes x 4 mini-batches: one policy update = 8 versions. The batch sampled at version 8 while batch 1
    # trained (8 -> 16) is one update old when it trains: kept. One that waited a further update (24): dropped.
    from gspo_ray.coordinator.loop import Coordinator, LoopState

    cfg = JobConfig.model_validate({"coordinator": {"mode": "async", "num_iterations": 2, "num_minibatches": 4,
                                                    "max_staleness": 1}})
    coord = Coordinator(cfg, rollout=None, trainer=None, prompts=None, state=LoopState())
    assert coord.buffer.max_staleness == 8
    assert coord.buffer.admit([_group("a", [1.0, 0.0], version=8)], current_version=16).admitted == 1
    assert coord.buffer.admit([_group("b", [1.0, 0.0], version=8)], current_version=24).stale == 1


def test_one_bug_is_one_group_whatever_its_messages_say():
    # 20 messages from one line of code, each embedding another length: before, 20 groups (exact text)
    reasons = {}
    for n in range(2, 22):
        count_reason(reasons, f"reward raised TypeError at letter_reward.py:4: ord() expected a character, but "
                              f"string of length {n} found")
    count_reason(reasons, "reward raised TypeError at letter_reward.py:9: unsupported operand")  # another line
    count_reason(reasons, "reward timed out after 5s")
    count_reason(reasons, "reward timed out after 5s")
    assert reasons == {"reward raised TypeError at letter_reward.py:4: ord() expected a character, but string of "
                       "length 2 found": 20,
                       "reward raised TypeError at letter_reward.py:9: unsupported operand": 1,
                       "reward timed out after 5s": 2}
    # no raising frame: grouped with numbers masked
    assert reason_group("reward returned 3.5, expected a finite float") == "reward returned #, expected a finite float"


def test_failure_line_shows_the_share_and_the_first_reason():
    line = failure_line(1, 159, 160, {"reward raised TypeError at r.py:4: ord() expected a character": 159})
    assert line == "step 1: 159/160 samples failed (99%): 'reward raised TypeError at r.py:4: ord() expected a " \
                   "character' x159"
    assert failure_line(2, 0, 160, {}) is None


def test_a_short_run_whose_every_step_failed_too_often_is_not_a_success():
    # 2 steps, max_failed_steps 3: the streak rule never fires; the end check does
    guard = FailureGuard(max_failed_share=0.2, max_failed_steps=3)
    guard.check(1, 100, 128, {"x": 100})
    guard.check(2, 90, 128, {"y": 90})
    with pytest.raises(TooManyFailedSamples, match=r"every one of the run's 2 step\(s\) had more than "
                                                    r"rollout.reward.max_failed_share \(0.2\) of its samples "
                                                    r"failed; last reasons: 'y' x90"):
        guard.check_end()
    guard = FailureGuard(max_failed_share=0.2, max_failed_steps=3)
    guard.check(1, 100, 128, {"x": 100})
    guard.check(2, 10, 128, {"x": 10})  # one step below the share: the run learned from something
    guard.check_end()
