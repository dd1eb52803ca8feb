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
