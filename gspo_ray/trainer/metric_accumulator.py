"""Mini-batch metrics from micro-batch and DP-rank pieces (weighted means, sums, extrema)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from gspo_ray.algo.metrics import is_max_key
from gspo_ray.trainer.routing.churn import comm_device


class MetricAccumulator:
    """Combines `compute_policy_loss` metrics of micro-batches and DP ranks into mini-batch values.

    `*_max` / `*_min` reduce by max / min; `train/n_tokens`, `train/n_seqs` and `train/loss` add up; sequence
    metrics (`*_seq*`, and `train/ratio_mean` at the sequence levels) are means weighted by sequences, the
    policy-gradient loss by the aggregation's units, everything else by tokens. Micro-batches without a trained
    token contribute nothing (their min/max would read 0).
    """

    SUMS = ("train/n_tokens", "train/n_seqs", "train/loss", "train/n_kept_tokens", "train/n_kept_seqs")
    # read over kept tokens only (a pg_weight of 0 drops a token): weighted by the kept counts when the
    # micro-batch reports them, and left out where it kept nothing (their min/max would read 0)
    KEPT_PREFIXES = ("train/clip_frac", "train/dual_clip_frac", "train/ratio_")
    SEQ_WEIGHTED = ("train/dilution_frac",)  # shares of completions whose key has no `_seq`

    @staticmethod
    def _is_max(key: str) -> bool:
        return is_max_key(key)

    def __init__(self, per_sequence_ratio: bool):
        self.per_sequence_ratio = per_sequence_ratio
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.extrema: dict[str, float] = {}

    def _weight(self, key: str, n_tok: float, n_seq: float, n_units: float) -> float:
        if key == "train/pg_loss":
            return n_units
        if "_seq" in key or key in self.SEQ_WEIGHTED or (key == "train/ratio_mean" and self.per_sequence_ratio):
            return n_seq
        return n_tok

    def add(self, metrics: dict[str, float], n_tok: float, n_seq: float, n_units: float) -> None:
        if n_tok == 0:
            return
        kept_tok, kept_seq = metrics.get("train/n_kept_tokens", n_tok), metrics.get("train/n_kept_seqs", n_seq)
        for key, value in metrics.items():
            if key.startswith(self.KEPT_PREFIXES):
                if kept_tok == 0:  # the key stays (0.0 when no micro-batch kept a token), the value does not count
                    self._add_nothing(key)
                    continue
                self._add_one(key, value, kept_tok, kept_seq, n_units)
            else:
                self._add_one(key, value, n_tok, n_seq, n_units)

    def _add_nothing(self, key: str) -> None:
        if self._is_max(key):
            self.extrema.setdefault(key, -math.inf)
        elif key.endswith("_min"):
            self.extrema.setdefault(key, math.inf)
        else:
            self.sums.setdefault(key, 0.0)
            self.weights.setdefault(key, 0.0)

    def _add_one(self, key: str, value: float, n_tok: float, n_seq: float, n_units: float) -> None:
        if self._is_max(key):
            self.extrema[key] = max(self.extrema.get(key, -math.inf), value)
        elif key.endswith("_min"):
            self.extrema[key] = min(self.extrema.get(key, math.inf), value)
        elif key in self.SUMS:
            self.sums[key] = self.sums.get(key, 0.0) + value
        else:
            w = self._weight(key, n_tok, n_seq, n_units)
            self.sums[key] = self.sums.get(key, 0.0) + value * w
            self.weights[key] = self.weights.get(key, 0.0) + w

    def add_sum(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def reduce(self, group=None) -> dict[str, float]:
        """All-reduce over `group` (the DP group: TP ranks of one DP rank hold the same rows) -> {key: value}."""
        keys = [sorted(self.sums), sorted(self.extrema)]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, keys, group=group)  # ranks whose rows were all padding know no keys
            keys = [sorted({k for ks in everyone for k in ks[i]}) for i in range(2)]
        sum_keys, ext_keys = keys
        sums = torch.tensor([[self.sums.get(k, 0.0), self.weights.get(k, 0.0)] for k in sum_keys],
                            dtype=torch.float64).reshape(-1, 2)
        # min folds into max by negation: one MAX all-reduce for both
        ext = torch.tensor([self.extrema.get(k, -math.inf if self._is_max(k) else math.inf)
                            * (1 if self._is_max(k) else -1) for k in ext_keys], dtype=torch.float64)
        if dist.is_initialized():
            sums, ext = sums.to(comm_device(group)), ext.to(comm_device(group))
            dist.all_reduce(sums, group=group)
            dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=group)
            sums, ext = sums.cpu(), ext.cpu()
        out = {}
        for k, (s, w) in zip(sum_keys, sums.tolist()):
            out[k] = s if k in self.SUMS else (s / w if w > 0 else 0.0)
        for k, v in zip(ext_keys, ext.tolist()):
            v = v if self._is_max(k) else -v
            out[k] = v if math.isfinite(v) else 0.0
        return out


def dp_token_metrics(tokens: float, group=None) -> dict[str, float]:
    """`train/forward_tokens`: the tokens the DP ranks' training forwards computed (padding included), summed over
    `group` (the DP group: TP ranks of one DP rank forward the same rows); `train/dp_imbalance`: the busiest rank's
    count over the mean (1.0 at DP 1; the step waits on the busiest rank)."""
    counts = torch.tensor([float(tokens)], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        device = comm_device(group)
        everyone = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, counts.to(device), group=group)
        counts = torch.cat(everyone).cpu()
    mean = float(counts.mean())
    return {"train/forward_tokens": float(counts.sum()),
            "train/dp_imbalance": float(counts.max()) / mean if mean > 0 else 1.0}

