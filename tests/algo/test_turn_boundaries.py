"""Explicit turn boundaries: two model turns with no environment token between them (an env that answered with
an empty observation) are still two turns, each compared with the same turn of the group's other episodes."""
import pytest
import torch

from gspo_ray.algo.advantages import compute_ragged_token_advantages, compute_turn_ids
from gspo_ray.coordinator.buffer import GroupBuffer
from gspo_ray.data.records import Group, Prompt
from gspo_ray.rollout.engine import Segment
from gspo_ray.rollout.episodes import Episode

# two episodes of one group, each: turn 0 = tokens 0-1, turn 1 = tokens 2-3, no env token in between
MASKS = [[1, 1, 1, 1], [1, 1, 1, 1]]
REWARDS = [[0.0, 1.0, 0.0, 0.0],   # A: turn 0 earns 1, turn 1 earns 0 -> G_A0 = 1, G_A1 = 0
           [0.0, 0.0, 0.0, 1.0]]   # B: turn 0 earns 0, turn 1 earns 1 -> G_B0 = 1, G_B1 = 1
STARTS = [[0, 2], [0, 2]]
STD = 2 ** -0.5  # std(ddof=1) of {0, 1}


def test_explicit_starts_split_adjacent_turns():
    starts = torch.zeros(2, 4, dtype=torch.bool)
    starts[:, [0, 2]] = True
    mask = torch.tensor(MASKS)
    assert compute_turn_ids(mask, starts).tolist() == [[0, 0, 1, 1], [0, 0, 1, 1]]
    assert compute_turn_ids(mask).tolist() == [[0, 0, 0, 0], [0, 0, 0, 0]]  # the fallback merges them


def test_per_turn_baseline_with_explicit_starts():
    adv = compute_ragged_token_advantages(REWARDS, MASKS, ["g", "g"], turn_starts=STARTS)
    a1 = -0.5 / (STD + 1e-4)
    # turn 0: both reward-to-go 1 -> A = 0; turn 1: A's 0 against B's 1
    assert adv[0] == pytest.approx([0.0, 0.0, a1, a1]) and adv[1] == pytest.approx([0.0, 0.0, -a1, -a1])
    # without boundaries the two turns are one: both episodes' G is 1 at the first token, no signal at all
    merged = compute_ragged_token_advantages(REWARDS, MASKS, ["g", "g"])
    assert merged == [[0.0] * 4, [0.0] * 4]
    # a row without starts falls back to mask runs; rows with env tokens give the same turns either way
    env_masks = [[1, 1, 0, 1, 1], [1, 1, 0, 1, 1]]
    env_rewards = [r[:2] + [0.0] + r[2:] for r in REWARDS]
    assert (compute_ragged_token_advantages(env_rewards, env_masks, ["g", "g"], turn_starts=[[0, 3], None])
            == compute_ragged_token_advantages(env_rewards, env_masks, ["g", "g"]))


def _episode(index: int, rewards: list[float]) -> Episode:
    """Two model turns of two tokens with an empty observation between them, rewards on turn ends."""
    e = Episode(prompt=Prompt(uid="p0", prompt_ids=[1, 2]), index=index)
    e.add_model(Segment(token_ids=[5, 6], logprobs=[-1.0, -1.0]), version=0)
    e.token_rewards[-1] = rewards[1]
    e.add_env([], version=0)  # the env answered with nothing
    e.add_model(Segment(token_ids=[7, 8], logprobs=[-1.0, -1.0]), version=0)
    e.token_rewards[-1] = rewards[3]
    e.end("stop")
    return e


def test_episodes_record_turn_starts_and_the_buffer_uses_them():
    samples = [_episode(i, r).to_sample(worker_id=0) for i, r in enumerate(REWARDS)]
    assert [s.turn_starts for s in samples] == STARTS and all(s.loss_mask == [1, 1, 1, 1] for s in samples)
    buf = GroupBuffer(per_token=True, token_baseline="turn", filter_zero_adv=False)
    buf.admit([Group(prompt=Prompt(uid="p0", prompt_ids=[1, 2]), samples=samples)], current_version=0)
    (g,) = buf.groups
    a1 = -0.5 / (STD + 1e-4)
    assert g.token_advantages[0] == pytest.approx([0.0, 0.0, a1, a1])
    assert g.token_advantages[1] == pytest.approx([0.0, 0.0, -a1, -a1])
