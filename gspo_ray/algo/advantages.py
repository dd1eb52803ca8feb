"""Group-relative advantages (GRPO/GSPO) for whole completions, and per-token advantages for process rewards.

    from gspo_ray.algo.advantages import compute_group_advantages
    adv, zero_var = compute_group_advantages(rewards)        # rewards: [G, n] -> adv: [G, n], zero_var: [G]

Formula (DeepSeekMath / ms-swift ``compute_advantages``), per group of n completions of one prompt:
    A_i = (R_i - mean(R)) / (std(R, ddof=1) + eps),   eps = 1e-4
With ``scale_by_std=False`` (Dr.GRPO) A_i = R_i - mean(R). A group whose rewards are all equal has A = 0 exactly
(forced, not left to float rounding of the mean) and is flagged, so the coordinator can drop and refill it.
A group of a single completion has no relative signal: A = 0 and flagged.
"""

from __future__ import annotations

import torch
from torch import Tensor

ADV_EPS = 1e-4


def compute_group_advantages(
    rewards: Tensor, scale_by_std: bool = True, eps: float = ADV_EPS
) -> tuple[Tensor, Tensor]:
    """Advantages for G equal-size groups. rewards: [G, n] -> (adv [G, n], zero_var [G] bool)."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [G, n] with n >= 2, got shape {tuple(rewards.shape)}")
    zero_var = rewards.amax(dim=1) == rewards.amin(dim=1)
    mean = rewards.mean(dim=1, keepdim=True)
    adv = rewards - mean
    if scale_by_std:
        # A_i = (R_i - mean(R)) / (std(R, ddof=1) + eps)
        adv = adv / (rewards.std(dim=1, keepdim=True, correction=1) + eps)
    adv = torch.where(zero_var[:, None], torch.zeros_like(adv), adv)
    return adv, zero_var


def compute_group_advantages_flat(
    rewards: Tensor, group_ids: Tensor, scale_by_std: bool = True, eps: float = ADV_EPS
) -> tuple[Tensor, Tensor]:
    """Advantages for ragged groups (failed samples removed). rewards: [N] float; group_ids: [N] int (any labels).

    Returns (adv [N], zero_var [N] bool), zero_var being the flag of each sample's group.
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [N], got {tuple(rewards.shape)}, {tuple(group_ids.shape)}"
        )
    _, gid = torch.unique(group_ids, return_inverse=True)  # labels -> 0..G-1
    n_groups = int(gid.max()) + 1 if gid.numel() else 0
    count = torch.bincount(gid, minlength=n_groups).to(rewards.dtype)  # [G]
    mean = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, gid, rewards) / count
    centred = rewards - mean[gid]
    r_max = torch.full_like(mean, -torch.inf).scatter_reduce(0, gid, rewards, "amax")
    r_min = torch.full_like(mean, torch.inf).scatter_reduce(0, gid, rewards, "amin")
    zero_var = ((r_max == r_min) | (count < 2))[gid]
    adv = centred
    if scale_by_std:
        sq = torch.zeros_like(mean).index_add_(0, gid, centred**2)
        # std(R, ddof=1) = sqrt( sum_i (R_i - mean)^2 / (n_g - 1) ); clamp only avoids 0/0 for singleton groups
        std = (sq / (count - 1).clamp(min=1)).sqrt()
        # A_i = (R_i - mean(R)) / (std(R, ddof=1) + eps)
        adv = centred / (std[gid] + eps)
    adv = torch.where(zero_var, torch.zeros_like(adv), adv)
    return adv, zero_var


def broadcast_sequence_advantages(adv: Tensor, mask: Tensor) -> Tensor:
    """One advantage per completion shared by its tokens. adv: [B], mask: [B, T] -> [B, T] (0 on padding)."""
    return torch.where(mask.bool(), adv[:, None].to(torch.result_type(adv, 0.0)), 0.0)


def compute_reward_to_go(token_rewards: Tensor, mask: Tensor) -> Tensor:
    """G_t = sum_{u >= t, m_u} r_u: undiscounted reward-to-go over loss-masked tokens. [B, T] -> [B, T]."""
    r = torch.where(mask.bool(), token_rewards,
                    torch.zeros((), dtype=token_rewards.dtype, device=token_rewards.device))
    return r.flip(-1).cumsum(-1).flip(-1)  # reverse cumulative sum


def compute_token_advantages(
    token_rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    scale_by_std: bool = True,
    eps: float = ADV_EPS,
) -> Tensor:
    """Per-token advantages from per-token (process) rewards, for `sequence_token`.

    token_rewards: [B, T] (reward credited at token t; padding and non-loss tokens ignored); mask: [B, T] bool;
    group_ids: [B] int (completions of the same prompt share a label). Returns adv: [B, T], 0 on padding.

    Choice: undiscounted reward-to-go, normalised over all loss-masked tokens of the group
        G_t = sum_{u >= t, m_u} r_u
        A_t = (G_t - mean_group(G)) / (std_group(G, ddof=1) + eps)
    where mean/std run over every loss-masked token of every completion in the group. A purely terminal reward
    (only the last token rewarded) gives G_t = R for all t, i.e. the completion's own reward on every token.
    Groups whose G values are all equal, or that hold a single token, get A = 0.
    """
    mask = mask.bool()
    reward_to_go = compute_reward_to_go(token_rewards, mask)
    tok_group = group_ids[:, None].expand_as(mask)[mask]
    adv_flat, _ = compute_group_advantages_flat(reward_to_go[mask], tok_group, scale_by_std, eps)
    adv = torch.zeros_like(reward_to_go)
    adv[mask] = adv_flat
    return adv



def compute_turn_ids(mask: Tensor, starts: Tensor | None = None) -> Tensor:
    """Turn index of every loss-masked token. With `starts` ([B, T] bool, True at each turn's first token: the
    episode runner's explicit boundaries) turn k begins at the k-th start. Without, the k-th maximal run of mask-1
    tokens in a row is turn k (0-based), which in a multi-turn episode is the model's k-th answer as long as
    environment tokens (mask 0) separate the answers; an empty observation would merge two answers into one run.
    mask: [B, T] -> [B, T] long, -1 where mask is 0."""
    mask = mask.bool()
    if starts is None:
        prev = torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)
        starts = mask & ~prev
    turn = starts.bool().long().cumsum(-1) - 1
    return torch.where(mask, turn, torch.full_like(turn, -1))


def compute_turn_token_advantages(
    token_rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    scale_by_std: bool = True,
    eps: float = ADV_EPS,
    turn_starts: Tensor | None = None,
) -> Tensor:
    """Per-token advantages with a per-turn baseline, for multi-turn episodes with per-turn rewards.

    Same reward-to-go as `compute_token_advantages`, but the baseline is taken per (group, turn): turn k of an
    episode is compared only with turn k of the other episodes of its group that reached a k-th turn,
        G_{i,k} = sum_{u >= start of turn k of episode i} r_{i,u}      (constant over the turn's tokens
                                                                        when rewards land on turn ends)
        A_{i,k} = (G_{i,k} - mean_j G_{j,k}) / (std_j(G_{j,k}, ddof=1) + eps),  j over the group's episodes
                                                                                with a turn k
    Why: with a cost per turn, an early turn's reward-to-go still contains every later cost, so one token-wide
    baseline ranks every first turn below every last one and pushes good first answers down; per turn, only
    episodes at the same point of the game are compared. A turn reached by a single episode of its group, or
    where all are equal, gets A = 0. Each episode-turn counts once, whatever its length.
    Shapes as in `compute_token_advantages`; returns adv [B, T], 0 off the mask. turn_starts: [B, T] bool, True at
    each model turn's first token (see `compute_turn_ids`); None = turns are the runs of mask-1 tokens.
    """
    mask = mask.bool()
    reward_to_go = compute_reward_to_go(token_rewards, mask)
    turn = compute_turn_ids(mask, turn_starts)
    num_turns = int(turn.max()) + 1 if mask.any() else 0
    first = mask & (turn != torch.nn.functional.pad(turn[:, :-1], (1, 0), value=-1))  # a turn's first token
    rows, cols = first.nonzero(as_tuple=True)
    g_turn = reward_to_go[rows, cols]  # G_{i,k}, one value per episode-turn
    _, gid = torch.unique(group_ids, return_inverse=True)
    labels = gid[rows] * max(num_turns, 1) + turn[rows, cols]  # (group, turn)
    adv_turn, _ = compute_group_advantages_flat(g_turn, labels, scale_by_std, eps)
    per_turn = torch.zeros(mask.shape[0], max(num_turns, 1), dtype=adv_turn.dtype, device=adv_turn.device)
    per_turn[rows, turn[rows, cols]] = adv_turn
    adv = torch.gather(per_turn, 1, turn.clamp(min=0))
    return torch.where(mask, adv, torch.zeros_like(adv))


def compute_ragged_token_advantages(token_rewards: list[list[float]], loss_masks: list[list[int]],
                                    group_keys: list, scale_by_std: bool = True, eps: float = ADV_EPS,
                                    baseline: str = "turn",
                                    turn_starts: list[list[int] | None] | None = None) -> list[list[float]]:
    """Per-token advantages of completions of different lengths (e.g. multi-turn episodes), one list per
    completion: reward-to-go over its `token_rewards`, compared per (group, turn) (`compute_turn_token_advantages`,
    baseline "turn") or over all the group's tokens (`compute_token_advantages`, baseline "group"); 0 where the
    loss mask is 0 (environment tokens). Completions with equal `group_keys` form a group. turn_starts: per
    completion, where each model turn starts (`Sample.turn_starts`), or None for that completion: its turns are
    then the runs of mask-1 tokens."""
    if baseline not in ("turn", "group"):
        raise ValueError(f"unknown token baseline {baseline!r}; valid: turn, group")
    if not token_rewards:
        return []
    lengths = [len(r) for r in token_rewards]
    T = max(lengths)
    rewards = torch.zeros(len(lengths), T, dtype=torch.float64)
    mask = torch.zeros(len(lengths), T, dtype=torch.bool)
    for b, (r, m) in enumerate(zip(token_rewards, loss_masks)):
        rewards[b, :len(r)] = torch.tensor(r, dtype=torch.float64)
        mask[b, :len(m)] = torch.tensor(m, dtype=torch.bool)
    labels = {key: i for i, key in enumerate(dict.fromkeys(group_keys))}
    group_ids = torch.tensor([labels[k] for k in group_keys])
    if baseline == "group":
        adv = compute_token_advantages(rewards, mask, group_ids, scale_by_std=scale_by_std, eps=eps)
    else:
        adv = compute_turn_token_advantages(rewards, mask, group_ids, scale_by_std=scale_by_std, eps=eps,
                                            turn_starts=_starts_tensor(turn_starts, mask))
    return [adv[b, :n].tolist() for b, n in enumerate(lengths)]


def _starts_tensor(turn_starts: list[list[int] | None] | None, mask: Tensor) -> Tensor | None:
    """[B, T] bool of explicit turn starts; rows without them fall back to mask-run starts. None if no row has any."""
    if turn_starts is None or all(t is None for t in turn_starts):
        return None
    prev = torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)
    starts = mask & ~prev  # the fallback, row by row
    for b, rows in enumerate(turn_starts):
        if rows:  # None or empty (no model token): the row keeps the fallback
            starts[b] = False
            if any(not 0 <= i < mask.shape[1] for i in rows):
                raise ValueError(f"turn_starts {rows} out of range for a completion of {mask.shape[1]} tokens")
            starts[b, list(rows)] = True
    return starts
