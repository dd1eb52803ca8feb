"""Typed records that cross actor boundaries.

A rollout worker returns `Sample`s (one per completion); the coordinator collects them into `Group`s (one per
prompt, the buffer's unit), computes advantages, and packs mini-batches into `TrainBatch`es for the trainer.
Token ids are the lingua franca: nothing is ever re-tokenised after the prompt was encoded once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads only where a batch is built: env and reward processes unpickle these records
    import torch


@dataclass
class Prompt:
    """One prompt as token ids, with whatever the reward function needs (e.g. the reference answer)."""

    uid: str  # stable id, unique within a job; groups are keyed by it
    prompt_ids: list[int]
    reference: Any = None
    text: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


FINISH_STOP, FINISH_LENGTH, FINISH_ABORTED = "stop", "length", "aborted"  # Sample.finish_reason


@dataclass
class Sample:
    """One completion of one prompt.

    Per-completion-token lists (`completion_ids`, `logprobs`, `loss_mask`, `versions`) all have the same length.
    `logprobs[t]` is the inference engine's log-prob of the sampled token `completion_ids[t]`: it is the old policy.
    `versions[t]` is the policy version that produced token t, stamped when its request was dispatched.
    """

    prompt_uid: str
    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    versions: list[int]
    finish_reason: str  # "stop" | "length" | "aborted"
    reward: float | None = None
    token_rewards: list[float] | None = None  # optional per-token (process) rewards, same length as completion_ids
    failed: str | None = None  # reason when the sample could not be scored; failed samples never train
    reward_info: dict[str, float] = field(default_factory=dict)
    worker_id: int | None = None
    segments: int = 1  # engine requests that produced it: > 1 for a partial rollout continued across rounds
    # the trainer's log-probs of the same tokens under the sampling weights (`recompute_old_logprobs`): then they
    # anchor the ratio and `logprobs` stays the engine's (the behaviour policy of mismatch corrections)
    old_logprobs: list[float] | None = None
    # multi-turn episodes: where each model turn starts (indices into completion_ids, increasing). Turns then
    # need no env token between them (an env may answer with an empty observation); None = derive turns from
    # runs of loss_mask 1
    turn_starts: list[int] | None = None
    # Routing Replay R3: the engine's top-k experts per position of prompt + completion, one entry per MoE layer
    # (`pack_routes`; -1 = a position the engine never computed). Position q holds the routing of the forward that
    # fed token q, so the routing that drew completion token t is at position t - 1. A continued completion keeps
    # its earlier positions' routes (first sight wins): each segment's tokens keep the routing that sampled them
    routes: dict | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.completion_ids)

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        for name in ("logprobs", "loss_mask", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Sample.{name} has {len(getattr(self, name))} entries, completion_ids has {n}")
        if self.routes is not None and self.routes["shape"][0] != len(self.prompt_ids) + n:
            raise ValueError(f"Sample.routes covers {self.routes['shape'][0]} positions, prompt + completion has "
                             f"{len(self.prompt_ids) + n}")


def pack_routes(routes) -> dict:
    """int16 array [positions, moe_layers, k] -> a JSON-ready record (checkpoints of open groups carry it)."""
    import base64

    import numpy as np

    a = np.ascontiguousarray(routes, dtype=np.int16)
    return {"shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode("ascii")}


def unpack_routes(record: dict):
    """`pack_routes`' record -> int16 array [positions, moe_layers, k]."""
    import base64

    import numpy as np

    return np.frombuffer(base64.b64decode(record["b64"]), dtype=np.int16).reshape(record["shape"]).copy()


@dataclass
class Group:
    """All completions of one prompt: the buffer's unit. Advantages are filled in by the coordinator."""

    prompt: Prompt
    samples: list[Sample]
    advantages: list[float] | None = None
    token_advantages: list[list[float]] | None = None

    @property
    def uid(self) -> str:
        return self.prompt.uid

    @property
    def rewards(self) -> list[float]:
        return [float(s.reward) if s.reward is not None else float("nan") for s in self.samples]

    def version_span(self) -> tuple[int, int]:
        vs = [v for s in self.samples for v in s.versions] or [0]
        return min(vs), max(vs)


@dataclass
class TrainBatch:
    """A padded mini-batch for the trainer; every tensor is aligned to `tokens` positions.

    tokens     [B, L] int64   prompt + completion, right-padded with 0
    loss_mask  [B, L] float   1 where tokens[b, t] is a completion token that trains
    old_logp   [B, L] float   engine log-prob of tokens[b, t] (0 where loss_mask is 0)
    adv        [B, L] float   advantage of tokens[b, t]
    lengths    [B]    int64   real length of each row
    rollout_logp [B, L] float engine log-prob when old_logp holds the trainer's recomputed ones, else None
    routes     [B, L, n, k] int16 the engine's experts per position and MoE layer (Sample.routes), else None
    versions   [B, L] int64   the policy version that sampled tokens[b, t] (-1 at prompt and padding), with routes
    """

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    old_logp: torch.Tensor
    adv: torch.Tensor
    lengths: torch.Tensor
    ref_logp: torch.Tensor | None = None
    uids: list[str] = field(default_factory=list)
    rollout_logp: torch.Tensor | None = None
    routes: torch.Tensor | None = None  # [B, L, moe_layers, k] int16 engine routes (R3), -1 = not recorded
    versions: torch.Tensor | None = None  # [B, L] int64 policy version of each sampled token, -1 elsewhere

    @property
    def num_sequences(self) -> int:
        return int(self.tokens.shape[0])

    def select(self, rows: list[int] | torch.Tensor) -> "TrainBatch":
        import torch

        idx = torch.as_tensor(rows, dtype=torch.long)
        return TrainBatch(
            tokens=self.tokens[idx],
            loss_mask=self.loss_mask[idx],
            old_logp=self.old_logp[idx],
            adv=self.adv[idx],
            lengths=self.lengths[idx],
            ref_logp=None if self.ref_logp is None else self.ref_logp[idx],
            uids=[self.uids[i] for i in idx.tolist()] if self.uids else [],
            rollout_logp=None if self.rollout_logp is None else self.rollout_logp[idx],
            routes=None if self.routes is None else self.routes[idx],
            versions=None if self.versions is None else self.versions[idx],
        )

    def narrow(self, width: int) -> "TrainBatch":
        """The same rows cut to their first `width` positions."""
        def cut(t):
            return None if t is None else t[:, :width]
        return TrainBatch(tokens=cut(self.tokens), loss_mask=cut(self.loss_mask), old_logp=cut(self.old_logp),
                          adv=cut(self.adv), lengths=self.lengths, ref_logp=cut(self.ref_logp), uids=self.uids,
                          rollout_logp=cut(self.rollout_logp), routes=cut(self.routes), versions=cut(self.versions))


def collate(samples: list[Sample], advantages: list[list[float]], pad_to_multiple: int = 1) -> TrainBatch:
    """Pack samples (with per-token advantages, one list per sample) into a right-padded TrainBatch."""
    import torch

    if len(samples) != len(advantages):
        raise ValueError(f"{len(samples)} samples but {len(advantages)} advantage rows")
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    L = max(lengths)
    L = ((L + pad_to_multiple - 1) // pad_to_multiple) * pad_to_multiple
    B = len(samples)
    tokens = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L)
    old = torch.zeros(B, L)
    adv = torch.zeros(B, L)
    recomputed = any(s.old_logprobs is not None for s in samples)
    rollout = torch.zeros(B, L) if recomputed else None
    routed = [s.routes for s in samples if s.routes is not None]
    routes = versions = None
    if routed:
        _, n_layers, k = routed[0]["shape"]
        routes = torch.full((B, L, n_layers, k), -1, dtype=torch.int16)
        versions = torch.full((B, L), -1, dtype=torch.long)
    for b, (s, a) in enumerate(zip(samples, advantages)):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        if len(a) != c:
            raise ValueError(f"sample {s.prompt_uid}/{s.sample_index}: {len(a)} advantages for {c} tokens")
        tokens[b, :p] = torch.tensor(s.prompt_ids)
        tokens[b, p:p + c] = torch.tensor(s.completion_ids)
        mask[b, p:p + c] = torch.tensor(s.loss_mask, dtype=torch.float)
        old[b, p:p + c] = torch.tensor(s.logprobs if s.old_logprobs is None else s.old_logprobs, dtype=torch.float)
        if rollout is not None:
            rollout[b, p:p + c] = torch.tensor(s.logprobs, dtype=torch.float)
        adv[b, p:p + c] = torch.tensor(a, dtype=torch.float)
        if routes is not None:
            versions[b, p:p + c] = torch.tensor(s.versions, dtype=torch.long)
            if s.routes is not None:
                if tuple(s.routes["shape"][1:]) != tuple(routes.shape[2:]):
                    raise ValueError(f"sample {s.prompt_uid}/{s.sample_index}: routes of shape {s.routes['shape']}, "
                                     f"others [positions, {routes.shape[2]}, {routes.shape[3]}]")
                routes[b, :p + c] = torch.from_numpy(unpack_routes(s.routes))
    return TrainBatch(tokens=tokens, loss_mask=mask, old_logp=old, adv=adv,
                      lengths=torch.tensor(lengths), uids=[f"{s.prompt_uid}/{s.sample_index}" for s in samples],
                      rollout_logp=rollout, routes=routes, versions=versions)
