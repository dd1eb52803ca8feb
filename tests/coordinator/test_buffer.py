"""Group buffer bookkeeping: whole groups, advantages, zero-advantage filter, staleness, mini-batches."""
import pytest
import torch

from gspo_ray.coordinator.buffer import GroupBuffer, pack_groups
from gspo_ray.coordinator.rollout_pool import assemble_groups
from gspo_ray.data.records import Group, Prompt, Sample


def _group(uid, rewards, version=0, lengths=None, failed=()):
    prompt = Prompt(uid=uid, prompt_ids=[5, 6, 7])
    lengths = lengths or [2] * len(rewards)
    samples = [Sample(prompt_uid=uid, sample_index=i, prompt_ids=[5, 6, 7], completion_ids=[9] * n,
                      logprobs=[-0.5] * n, loss_mask=[1] * n, versions=[version] * n, finish_reason="stop",
                      reward=r, failed="reward raised" if i in failed else None)
               for i, (r, n) in enumerate(zip(rewards, lengths))]
    return Group(prompt=prompt, samples=samples)


def test_admit_computes_seed_advantages_and_filters_zero_variance():
    buf = GroupBuffer()
    # seed §1: 6 x 1.000 and 2 x 0.889 -> +0.539 / -1.617; an all-equal group carries no signal
    informative = _group("a", [1.0] * 6 + [0.889] * 2)
    flat = _group("b", [1.0] * 8)
    stats = buf.admit([informative, flat], current_version=0)
    assert (stats.offered, stats.admitted, stats.zero_adv) == (2, 1, 1)
    assert len(buf) == 1
    assert buf.groups[0].advantages[0] == pytest.approx(0.539, abs=5e-4)
    assert buf.groups[0].advantages[-1] == pytest.approx(-1.617, abs=5e-4)


def test_failed_samples_leave_their_group_and_tiny_groups_drop():
    buf = GroupBuffer()
    g = _group("a", [1.0, 0.0, 0.5, 0.0], failed={2})
    lone = _group("b", [1.0, 0.0], failed={0})
    stats = buf.admit([g, lone], current_version=0)
    assert stats.failed_samples == 2 and stats.failed == 1 and stats.admitted == 1
    assert [s.sample_index for s in buf.groups[0].samples] == [0, 1, 3]
    assert len(buf.groups[0].advantages) == 3


def test_staleness_bound_drops_old_groups():
    buf = GroupBuffer(max_staleness=1)
    stats = buf.admit([_group("old", [0.0, 1.0], version=3), _group("ok", [0.0, 1.0], version=4)],
                      current_version=5)
    assert stats.stale == 1 and [g.uid for g in buf.groups] == ["ok"]
    assert buf.drop_stale(current_version=6) == 1 and len(buf) == 0


def test_minibatches_hold_whole_groups_and_broadcast_advantages():
    buf = GroupBuffer(seed=1)
    groups = [_group(f"g{i}", [0.0, 1.0, 2.0, 3.0], lengths=[1, 2, 3, 4]) for i in range(4)]
    buf.admit(groups, current_version=0)
    batches = buf.minibatches(buf.take(4), num_minibatches=2)
    assert [b.num_sequences for b in batches] == [8, 8]
    seen = set()
    for b in batches:
        uids = {u.split("/")[0] for u in b.uids}
        assert len(uids) == 2 and not (uids & seen)      # two whole groups, no group in two mini-batches
        seen |= uids
        for row in range(b.num_sequences):
            mask = b.loss_mask[row].bool()
            vals = b.adv[row][mask]
            assert torch.all(vals == vals[0])              # one advantage per completion, shared by its tokens
            assert torch.all(b.adv[row][~mask] == 0)
    assert seen == {f"g{i}" for i in range(4)}


def test_pack_aligns_old_logprobs_with_completion_tokens():
    g = _group("a", [0.0, 1.0], lengths=[1, 3])
    g.advantages = [-0.7, 0.7]
    b = pack_groups([g])
    assert b.tokens.shape == (2, 6) and b.lengths.tolist() == [4, 6]
    assert b.loss_mask[1].tolist() == [0, 0, 0, 1, 1, 1]
    assert b.old_logp[1, 3:].tolist() == [-0.5] * 3 and b.adv[0, 3].item() == pytest.approx(-0.7)


def test_assemble_groups_detects_lost_and_duplicated_samples():
    prompts = [Prompt(uid=u, prompt_ids=[1]) for u in ("p0", "p1")]
    samples = _group("p0", [0, 1]).samples + _group("p1", [0, 1]).samples
    groups = assemble_groups(prompts, samples, n=2)
    assert [g.uid for g in groups] == ["p0", "p1"]
    with pytest.raises(RuntimeError, match="lost or duplicated"):
        assemble_groups(prompts, samples[:3], n=2)
    with pytest.raises(RuntimeError, match="lost or duplicated"):
        assemble_groups(prompts, samples + samples[:1], n=2)


def _episode(uid, index, turns, failed=False):
    """An episode: per turn (model tokens, turn reward, env tokens). Each turn's reward sits on its last model
    token; env tokens are loss-masked."""
    ids, mask, rewards = [], [], []
    for n_model, reward, n_env in turns:
        ids += [9] * n_model + [4] * n_env
        mask += [1] * n_model + [0] * n_env
        rewards += [0.0] * (n_model - 1) + [reward] + [0.0] * n_env
    n = len(ids)
    return Sample(prompt_uid=uid, sample_index=index, prompt_ids=[5, 6], completion_ids=ids, logprobs=[-0.5] * n,
                  loss_mask=mask, versions=[0] * n, finish_reason="stop", reward=None if failed else sum(rewards),
                  token_rewards=None if failed else rewards, failed="env raised" if failed else None)


def test_per_token_advantages_are_reward_to_go_and_reach_the_batch():
    # Two episodes of one prompt (Dr.GRPO scaling, so the numbers stay readable):
    #   e0: invalid (-0.5) then correct (+1)  -> reward-to-go per model token: 0.5, 0.5 | 1.0, 1.0
    #   e1: one correct guess (+1)            -> 1.0, 1.0
    #   a failed third episode has no token rewards and must be dropped before the maths.
    # Token mean over the group's 6 model tokens = (0.5*2 + 1.0*4) / 6 = 5/6.
    samples = [_episode("a", 0, [(2, -0.5, 1), (2, 1.0, 1)]), _episode("a", 1, [(2, 1.0, 1)]),
               _episode("a", 2, [(2, 1.0, 1)], failed=True)]
    g = Group(prompt=Prompt(uid="a", prompt_ids=[5, 6]), samples=samples)
    buf = GroupBuffer(per_token=True, scale_by_std=False, token_baseline="group")
    stats = buf.admit([g], current_version=0)
    assert stats.admitted == 1 and stats.failed_samples == 1
    adv = buf.groups[0].token_advantages
    assert [len(a) for a in adv] == [6, 3]
    assert adv[0] == pytest.approx([0.5 - 5 / 6] * 2 + [0.0] + [1 - 5 / 6] * 2 + [0.0])   # env tokens get 0
    assert adv[1] == pytest.approx([1 - 5 / 6] * 2 + [0.0])
    assert buf.groups[0].advantages == pytest.approx([-0.25, 0.25])                      # sequence: 0.5 vs 1.0
    b = pack_groups(buf.groups)
    assert b.adv[0, 2:8].tolist() == pytest.approx(adv[0]) and b.adv[1, 2:5].tolist() == pytest.approx(adv[1])
    # The per-turn baseline (the default) compares turn 0 with turn 0: 0.5 vs 1.0 -> -0.25 / +0.25; e0's second
    # turn has no counterpart in the group (e1 solved at once), so it carries no signal.
    turn = GroupBuffer(per_token=True, scale_by_std=False)
    turn.admit([Group(prompt=g.prompt, samples=samples[:2])], current_version=0)
    assert turn.groups[0].token_advantages == [pytest.approx([-0.25, -0.25, 0, 0, 0, 0]),
                                               pytest.approx([0.25, 0.25, 0])]
    # Without the flag the same group trains on one advantage per episode.
    plain = GroupBuffer(scale_by_std=False)
    plain.admit([Group(prompt=g.prompt, samples=samples[:2])], current_version=0)
    assert plain.groups[0].token_advantages is None
    assert pack_groups(plain.groups).adv[0, 2:4].tolist() == pytest.approx([-0.25, -0.25])


def test_per_token_keeps_the_zero_variance_filter_on_episode_rewards():
    # Equal episode rewards (1.0 each) but different turn structure: reward-to-go differs per token, yet the
    # group carries no episode-level preference and is filtered like any zero-variance group.
    samples = [_episode("a", 0, [(2, -0.5, 1), (2, 1.5, 1)]), _episode("a", 1, [(2, 1.0, 1)])]
    buf = GroupBuffer(per_token=True)
    stats = buf.admit([Group(prompt=Prompt(uid="a", prompt_ids=[5, 6]), samples=samples)], current_version=0)
    assert (stats.admitted, stats.zero_adv, len(buf)) == (0, 1, 0)
    # Single-turn samples scored without token rewards cannot train per token: the error names the knob.
    with pytest.raises(ValueError, match=r"per_token is set but samples \['b/0', 'b/1'\] carry no token_rewards"):
        GroupBuffer(per_token=True).admit([_group("b", [0.0, 1.0])], current_version=0)


def test_rollout_metrics_separate_model_and_env_tokens():
    from gspo_ray.coordinator.rollout_pool import rollout_metrics

    samples = [_episode("a", 0, [(2, -0.5, 1), (2, 1.0, 1)]), _episode("a", 1, [(2, 1.0, 1)])]
    for s, turns in zip(samples, (2, 1)):
        s.reward_info["turns"] = float(turns)
    m = rollout_metrics(samples, 2.0, multi_turn=True)
    assert (m["rollout/tokens"], m["rollout/env_tokens"], m["rollout/turns"]) == (6, 3, 3.0)
    assert rollout_metrics(samples, 2.0)["rollout/tokens"] == 9                       # single turn: all tokens
    assert "rollout/info/turns" not in m  # already rollout/turns
    # what a reward returns besides `reward` is summed per key (the loop divides by rollout/samples)
    samples[0].reward_info.update(exact=1.0, char_acc=0.5)
    samples[1].reward_info.update(exact=0.0, char_acc=0.25)
    single = rollout_metrics(samples, 2.0)
    assert (single["rollout/info/exact"], single["rollout/info/char_acc"]) == (1.0, 0.75)
