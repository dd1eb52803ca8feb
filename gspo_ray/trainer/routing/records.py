"""The per-row routing record store of Routing Replay (R2), routing drift and the routing-noise probe.

    store = RecordStore(num_layers)
    store.record(key, layer, idx)        # idx int16 [length, k]: kept when it is the key's next layer (first sight)
    store.lookup(key)                    # [one [length, k] per layer], or None while incomplete
    store.fetch(keys, mine, dp_group)    # collective: the records of rows this rank forwards now come to it
    store.end_batch()                    # the rollout batch's passes are done: forget everything
    store.nbytes()                       # bytes of the records held here

Bounds. A record lives as long as its rollout batch: the coordinator calls `end_batch` (TrainerPool.end_batch)
when the batch's last pass is done, so a store holds at most the current batch's rows. Each record sits on one DP
rank only, the one that forwarded the row last: at the start of a call every rank says (one byte per row) which
rows it holds and which of the rows it forwards now it lacks, and a record moves (all-to-all, only the records
asked for) from its holder to the rank that needs it. Summed over the DP ranks the stores hold one batch's records;
nothing is copied to every rank.

Keys are `batch_layout.routing_keys`; None marks a padding row or dummy (a copy of row 0), which is never stored,
compared or moved.
"""
from __future__ import annotations

import pickle

import numpy as np
import torch
import torch.distributed as dist

from gspo_ray.trainer.routing.churn import comm_device


class RecordStore:
    """key -> one int16 [length, k] tensor per MoE layer, for the rows of the current rollout batch."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.records: dict[str, list[torch.Tensor]] = {}

    # ---- one rank's view ----------------------------------------------------------------------------------------
    def record(self, key: str | None, layer: int, idx: torch.Tensor) -> bool:
        """Keep `idx` as layer `layer` of `key` when the key has exactly its layers before it (the first sight
        wins: a complete record is never overwritten). Returns whether it was kept."""
        if key is None:
            return False
        layers = self.records.setdefault(key, [])
        if len(layers) != layer:
            return False
        layers.append(idx)
        return True

    def lookup(self, key: str | None) -> list[torch.Tensor] | None:
        """The complete record of `key`, or None (never seen, or an interrupted forward's partial one)."""
        layers = self.records.get(key) if key is not None else None
        return layers if layers is not None and len(layers) == self.num_layers else None

    def known(self, key: str | None) -> bool:
        return self.lookup(key) is not None

    def drop_partial(self, keys) -> None:
        """Partial records of `keys` (a forward interrupted between layers) start over."""
        for key in keys:
            if key is not None and key in self.records and not self.known(key):
                del self.records[key]

    def end_batch(self) -> None:
        """The rollout batch is done: no later forward replays or compares its rows."""
        self.records.clear()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layers in self.records.values() for t in layers)

    def __len__(self) -> int:
        return len(self.records)

    def __contains__(self, key) -> bool:
        return key in self.records

    def __getitem__(self, key: str) -> list[torch.Tensor]:
        return self.records[key]

    def keys(self):
        return self.records.keys()

    def items(self):
        return self.records.items()

    # ---- across DP ranks ----------------------------------------------------------------------------------------
    def fetch(self, keys: list[str | None], mine: set[int], group=None) -> int:
        """Collective over `group` (the DP group), at the start of a call over a batch whose row b has key
        keys[b] (every rank passes the same keys): the complete records of the rows this rank forwards (`mine`,
        row indices) that another rank holds move here. Returns how many arrived."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return 0
        n, me, device = dist.get_world_size(group), dist.get_rank(group), comm_device(group)
        have = torch.tensor([self.known(k) for k in keys], dtype=torch.uint8)
        need = torch.tensor([b in mine and keys[b] is not None and not have[b] for b in range(len(keys))],
                            dtype=torch.uint8)
        both = torch.stack([have, need]).to(device)
        parts = [torch.empty_like(both) for _ in range(n)]
        dist.all_gather(parts, both, group=group)
        table = torch.stack(parts).cpu()  # [rank, have/need, row]
        outgoing: list[dict] = [{} for _ in range(n)]
        for b in torch.nonzero(table[:, 1].any(0)).flatten().tolist():
            holders = torch.nonzero(table[:, 0, b]).flatten().tolist()
            if not holders or holders[0] != me:
                continue  # first sight (nobody holds it: the forward records it) or another rank sends it
            for d in torch.nonzero(table[:, 1, b]).flatten().tolist():
                outgoing[d][keys[b]] = [t.numpy() for t in self.records[keys[b]]]
            if b not in mine:  # moved, not copied: one rank holds a record
                del self.records[keys[b]]
        arrived = 0
        for records in _all_to_all_objects(outgoing, group, device):
            for key, layers in records.items():
                if not self.known(key):
                    self.records[key] = [torch.from_numpy(a) for a in layers]
                    arrived += 1
        return arrived


def _all_to_all_objects(outgoing: list[dict], group, device) -> list[dict]:
    """outgoing[d]: what this rank sends rank d -> what every rank sent this one (pickled, one all-to-all of the
    payload bytes after one all-gather of their sizes)."""
    n = len(outgoing)
    blobs = [pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL) if o else b"" for o in outgoing]
    sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64, device=device)
    table = [torch.empty_like(sizes) for _ in range(n)]
    dist.all_gather(table, sizes, group=group)
    if int(torch.stack(table).sum()) == 0:  # the same on every rank: nothing moves, no all-to-all
        return []
    me = dist.get_rank(group)
    recv = [int(t[me]) for t in table]
    send = torch.from_numpy(np.frombuffer(b"".join(blobs), dtype=np.uint8).copy()).to(device)
    out = torch.empty(sum(recv), dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, send, output_split_sizes=recv, input_split_sizes=[len(b) for b in blobs],
                           group=group)
    data, start, got = out.cpu().numpy().tobytes(), 0, []
    for size in recv:
        if size:
            got.append(pickle.loads(data[start:start + size]))
        start += size
    return got
