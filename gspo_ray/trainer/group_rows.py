"""Shared-prefix ("group row") layout: the completions of one prompt forwarded as one row, the prompt once.

Rows b_1..b_G of a TrainBatch that belong to one prompt (same prompt_uid in `uids = "prompt_uid/sample_index"`)
and share their first P tokens become one group row

    [ x_0 .. x_{P-1} | c_1 | c_2 | ... | c_G ]            c_j = tokens[b_j, P:lengths[b_j]]   (may be empty)

with
  * attention by segment (segment_attention.Segments: prefix P, segments c_1..c_G): a query in the prefix sees
    the prefix causally; a query in segment j sees the whole prefix and the earlier tokens of segment j, nothing
    of other segments. No [W, W] mask exists: the kernel's work is P (P + 1) / 2 + sum_j c_j (P + (c_j + 1) / 2)
    query-key pairs (segment_attention.row_pairs);
  * position ids 0..P-1 on the prefix and P, P+1, ... on every segment (each continues from the prefix);
  * an index map `col_of[b, t]`: the group-row column holding tokens[b, t] (t < P: t; t >= P: start_j + t - P).

So the model output at column col_of[b, t-1] depends on exactly tokens[b, :t] at positions 0..t-1: it *is* the
unshared row's output at t - 1, and it scores tokens[b, t] (the prefix's last column scores the first token of
every segment). Correctness needs only that P is a common prefix of the group's rows, never where the prompt
ends: P is the longest common prefix of the rows (a completion's first tokens may be shared too), nothing is
guessed from loss_mask (fully masked completions are just rows like the others), and a group whose rows share
no token is forwarded as separate rows.

Micro-batches. A group row holds at most `max_rows` completions and, when a width cap is given, at most that many
tokens (activations grow linearly with the width; attention no longer grows with its square, so nothing else
splits a group row). Group rows are then put into micro-batches of at most `max_rows` completions and, with a
cap, at most `max_tokens` tokens, in one of two layouts:
  * packed (the default, `packed=True`): the micro-batch is ONE row [g_1 | g_2 | .. | tail], its group rows one
    after another (each its own prefix and segments; `Segments(packed=True)`, positions restarting at 0 in each),
    so no padding is forwarded but a tail of fewer than `width_multiple` tokens (sequence parallelism needs the
    width to be a multiple of TP; the tail attends to nothing and scores nothing). The cap counts real tokens;
    first-fit over the group rows, longest first. A group row of one sequence and no shared prefix is a plain
    causal sequence, so the same layout packs unshared rows (batch_layout.row_micro_batches);
  * padded (`packed=False`): R rows of the longest group row's width (longest first, the cap counting R x W,
    none padded past PAD_SHARE x its width).
The planning below works on plain lists (rows, prefix lengths, row lengths), so the scale model (bench/scale.py)
runs it without tensors; everything is deterministic, so every rank derives the same layout.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from gspo_ray.data.records import TrainBatch
from gspo_ray.trainer.attention.segment_attention import Segments, row_pairs

log = logging.getLogger(__name__)

PAD_SHARE = 1.25  # a group row joins a micro-batch only if padded to at most this many times its width
_warned: set[str] = set()


def warn_once(key: str, msg: str, *args) -> None:
    """log.warning the first time `key` is seen in this process (fallbacks are per-batch decisions)."""
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


@dataclass(frozen=True)
class GroupRow:
    """Rows (indices into a batch) forwarded as one group row: a shared prefix of `prefix` tokens, then each
    row's remaining tokens; `segments[j] = lengths[rows[j]] - prefix`."""

    rows: tuple[int, ...]
    prefix: int
    segments: tuple[int, ...]

    @property
    def length(self) -> int:
        return self.prefix + sum(self.segments)

    @property
    def pairs(self) -> int:
        """Query-key pairs attention by segment computes for this group row (segment_attention.row_pairs)."""
        return row_pairs(self.prefix, self.segments)


@dataclass
class GroupLayout:
    """The tensors of one micro-batch of group rows (R rows of width W) for a batch of B rows of width L. Packed:
    R = 1, the group rows one after another in it (`segments.packed`), padding at its tail only.

    tokens         [R, W] long   rows, right padded with 0 (W a multiple of `width_multiple`)
    position_ids   [R, W] long   per group row: prefix 0..P-1, each segment P, P+1, ...; padding: its column index
    segments       Segments      prefix and segment lengths of each group row (the attention's layout;
                                 padding columns attend to nothing)
    lengths        [R]    long   real tokens of each row (padding starts there)
    row_of         [B]    long   the row holding original row b
    col_of         [B, L] long   the column of tokens[b, t] in row row_of[b]; -1 at t >= lengths[b]
    """

    tokens: Tensor
    position_ids: Tensor
    segments: Segments
    lengths: Tensor
    row_of: Tensor
    col_of: Tensor

    @property
    def num_tokens(self) -> int:
        """Tokens forwarded (padding included)."""
        return int(self.tokens.numel())


def prompt_key(uid: str) -> str:
    """"prompt_uid/sample_index" -> "prompt_uid" (a uid without "/" is its own prompt)."""
    return uid.rsplit("/", 1)[0]


def find_groups(uids: list[str], num_rows: int) -> list[list[int]] | None:
    """Row indices per prompt, in order of first appearance; None when the rows carry no (or wrong) uids."""
    if not uids or len(uids) != num_rows:
        return None
    groups: dict[str, list[int]] = {}
    for i, uid in enumerate(uids):
        groups.setdefault(prompt_key(uid), []).append(i)
    return list(groups.values())


def common_prefix(tokens: Tensor, lengths: Tensor, rows: list[int]) -> int:
    """Length of the longest common prefix of tokens[rows[j], :lengths[rows[j]]] (at most the shortest row)."""
    shortest = min(int(lengths[b]) for b in rows)
    block = tokens[rows, :shortest]
    differs = (block != block[:1]).any(dim=0).nonzero()
    return int(differs[0]) if len(differs) else shortest


def split_group(rows: list[int], prefix: int, lengths: list[int], max_rows: int,
                max_width: int | None) -> list[GroupRow]:
    """One prompt's rows -> group rows of at most max_rows rows and max_width tokens (when set); each group row has
    at least one row (a row longer than the cap still trains, alone)."""
    out, cur, width = [], [], prefix
    for b in rows:
        seg = lengths[b] - prefix
        if cur and (len(cur) >= max_rows or (max_width is not None and width + seg > max_width)):
            out.append(GroupRow(tuple(cur), prefix, tuple(lengths[c] - prefix for c in cur)))
            cur, width = [], prefix
        cur.append(b)
        width += seg
    if cur:
        out.append(GroupRow(tuple(cur), prefix, tuple(lengths[c] - prefix for c in cur)))
    return out


def routes_prefix(routes: Tensor, rows: list[int], limit: int) -> int:
    """Length p <= limit of the prefix over which rows `rows` of `routes` ([B, L, layers, k] engine routes, -1 = not
    recorded) agree: at every position q < p and MoE layer, the recorded top-k sets (order ignored) are equal; a row
    without a record there agrees with any."""
    r = routes[rows, :limit].long().sort(-1).values                      # [G, limit, layers, k]
    rec = (r >= 0).all(-1)                                               # [G, limit, layers]
    clash = (r[:, None] != r[None, :]).any(-1) & rec[:, None] & rec[None, :]  # [G, G, limit, layers]
    bad = clash.flatten(0, 1).any(0).any(-1).nonzero()
    return int(bad[0]) if len(bad) else limit


def prefix_groups(batch: TrainBatch, match_routes: bool = False) -> list[tuple[list[int], int]] | None:
    """(rows, longest common prefix) per prompt group of a batch (prefix 0 for a group of one row), or None when
    the rows carry no (or wrong) uids. match_routes: the prefix also ends where the rows' engine routes
    (`batch.routes`) disagree, so that R3 can replay every row's own routes on the shared columns."""
    groups = find_groups(batch.uids, batch.num_sequences)
    if groups is None:
        warn_once("no_uids", "shared_prefix: batch rows carry no prompt uids; forwarding unshared rows")
        return None
    out = []
    for rows in groups:
        prefix = common_prefix(batch.tokens, batch.lengths, rows) if len(rows) > 1 else 0
        if prefix and match_routes and batch.routes is not None:
            prefix = routes_prefix(batch.routes, rows, prefix)
        out.append((rows, prefix))
    return out


def plan_units(groups: list[tuple[list[int], int]], lengths: list[int], max_rows: int,
               max_width: int | None = None, uids: list[str] | None = None) -> list[GroupRow] | None:
    """The group rows of `groups` ((rows, common prefix) per prompt; lengths: every row's length), or None when
    nothing is shared (no group of >= 2 rows sharing >= 1 token). A prompt whose rows share no token is laid out
    as one group row per row (causal, nothing shared) and logged once (naming uids[row] when given)."""
    out, shared = [], False
    for rows, prefix in groups:
        if prefix == 0:
            if len(rows) > 1:
                warn_once("no_prefix", "shared_prefix: rows of prompt group %s share no prefix; forwarding them "
                          "unshared", uids[rows[0]] if uids else rows)
            out += [GroupRow((b,), lengths[b], (0,)) for b in rows]
            continue
        parts = split_group(rows, prefix, lengths, max_rows, max_width)
        shared |= any(len(p.rows) > 1 for p in parts)
        out += parts
    return out if shared else None


def halve(unit: GroupRow) -> tuple[GroupRow, GroupRow]:
    """A group row of >= 2 rows as two group rows with the same prefix (the first half of its rows, the rest)."""
    k = len(unit.rows) // 2
    return (GroupRow(unit.rows[:k], unit.prefix, unit.segments[:k]),
            GroupRow(unit.rows[k:], unit.prefix, unit.segments[k:]))


def pack_group_rows(units: list[GroupRow], max_rows: int, max_tokens: int | None = None,
                    packed: bool = False) -> list[list[GroupRow]]:
    """Group rows -> micro-batches of at most max_rows completions each and (with a cap) at most max_tokens tokens;
    a unit over the caps goes alone. Packed: the cap counts real tokens (sum of the group rows' lengths), each
    unit (longest first) to the first micro-batch it fits (first-fit decreasing). Padded: longest first, the cap
    counting group rows x the longest one, and no group row padded to more than PAD_SHARE x its width (long-tailed
    lengths waste no more than that)."""
    order = sorted(range(len(units)), key=lambda i: (-units[i].length, i))
    if packed:
        return _first_fit([units[i] for i in order], max_rows, max_tokens)
    packs, cur, rows, width = [], [], 0, 0
    for i in order:
        u = units[i]
        w = max(width, u.length)
        n = len(cur) + 1
        if cur and (rows + len(u.rows) > max_rows or (max_tokens is not None and n * w > max_tokens)
                    or u.length * PAD_SHARE < w):
            packs.append(cur)
            cur, rows, w = [], 0, u.length
        cur.append(u)
        rows += len(u.rows)
        width = w
    if cur:
        packs.append(cur)
    return packs


def _first_fit(units: list[GroupRow], max_rows: int, max_tokens: int | None) -> list[list[GroupRow]]:
    """Each unit, in order, to the first pack with room for its rows and (with a cap) its tokens; else a new one."""
    packs: list[list[GroupRow]] = []
    room: list[tuple[int, int]] = []  # (rows, tokens) used per pack
    for u in units:
        for k, (rows, tokens) in enumerate(room):
            if rows + len(u.rows) <= max_rows and (max_tokens is None or tokens + u.length <= max_tokens):
                packs[k].append(u)
                room[k] = (rows + len(u.rows), tokens + u.length)
                break
        else:
            packs.append([u])
            room.append((len(u.rows), u.length))
    return packs


def build_layout(batch: TrainBatch, units: list[GroupRow], width_multiple: int = 1,
                 packed: bool = False) -> GroupLayout:
    """The GroupLayout of `units`, whose rows index `batch` and together cover each of its rows exactly once: a row
    per unit, or (packed) one row holding them all, each unit's positions from 0."""
    b, length = batch.tokens.shape
    widths = [u.length for u in units]
    width = max(sum(widths) if packed else max(widths, default=1), 1)
    width = -(-width // width_multiple) * width_multiple
    r = 1 if packed else len(units)
    tokens = torch.zeros(r, width, dtype=torch.long)
    positions = torch.arange(width).repeat(r, 1)
    row_of = torch.full((b,), -1, dtype=torch.long)
    col_of = torch.full((b, length), -1, dtype=torch.long)
    offset = 0  # packed: where the unit starts in the one row
    for g, u in enumerate(units):
        row, p = (0, u.prefix) if packed else (g, u.prefix)
        tokens[row, offset:offset + p] = batch.tokens[u.rows[0], :p]
        positions[row, offset:offset + p] = torch.arange(p)
        start = offset + p
        for orig, n in zip(u.rows, u.segments):
            if row_of[orig] >= 0:
                raise ValueError(f"row {orig} is in two group rows")
            row_of[orig] = row
            col_of[orig, :p] = torch.arange(offset, offset + p)
            tokens[row, start:start + n] = batch.tokens[orig, p:p + n]
            positions[row, start:start + n] = torch.arange(p, p + n)
            col_of[orig, p:p + n] = torch.arange(start, start + n)
            start += n
        if packed:
            offset = start
    if (row_of < 0).any():
        raise ValueError(f"rows {(row_of < 0).nonzero().flatten().tolist()} are in no group row")
    segments = Segments(prefix=tuple(u.prefix for u in units), completions=tuple(u.segments for u in units),
                        packed=packed)
    lengths = [sum(widths)] if packed else widths
    return GroupLayout(tokens=tokens, position_ids=positions, segments=segments,
                       lengths=torch.tensor(lengths, dtype=torch.long), row_of=row_of, col_of=col_of)


def shard_token_order(layout: GroupLayout, lengths: Tensor, s_local: int, offset: int) -> Tensor:
    """Re-expand per-token records of a group forward into the unshared layout's tokens.

    A hook that records one entry per real group-row token of this rank's sequence shard, sequence-major
    (entry order: column s in [offset, offset + s_local), then group row r, keeping s < layout.lengths[r]; what
    routing.churn.RouterRecorder keeps), gives a list X. Returns idx such that X[idx] holds one entry per real token
    (b, t < lengths[b]) of the original rows whose column lies in this shard, row-major: prefix tokens appear once
    per row that uses them, as in an unshared forward.
    """
    r = layout.tokens.shape[0]
    cols = torch.arange(offset, offset + s_local)
    kept = cols[:, None] < layout.lengths[None, :r]                       # [S_local, R] recorded entries
    entry = torch.cumsum(kept.reshape(-1).long(), 0).reshape(kept.shape) - 1
    b_idx, t_idx = (torch.arange(layout.col_of.shape[1])[None] < lengths[:, None]).nonzero(as_tuple=True)
    col = layout.col_of[b_idx, t_idx]
    mine = (col >= offset) & (col < offset + s_local)
    return entry[col[mine] - offset, layout.row_of[b_idx[mine]]]
