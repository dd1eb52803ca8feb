"""Multi-turn episodes on a RolloutEngine: the model acts, an environment answers with tokens, turn by turn.

    runner = EpisodeRunner.from_config(engine, cfg.rollout.multi_turn, tokenizer)
    samples = runner.run(prompts, n=8, sampling=SamplingSettings(temperature=1.0), version=3, seed=0)

One episode = one `Sample` whose `completion_ids` interleave
- model tokens: loss_mask 1, the engine's log-prob, `versions` = the policy version of the call;
- environment tokens: loss_mask 0, log-prob 0.0 (never used), `versions` = the version of the action they answer
  (so version spans and staleness checks see only real policy versions).
Token-in/token-out: each turn's engine prompt is exactly prompt_ids + completion_ids so far; nothing is
re-tokenised (prefix caching makes the re-prefill cheap). Each turn's reward sits on the last model token of the
turn in `token_rewards` (0 elsewhere); `reward` is their sum. So `compute_token_advantages` (reward-to-go) credits
each action with the rewards that follow it, and the sequence-level path sees the episode reward.

Turns run batched: all live episodes generate their turn together; each env step starts in the episode's env
host (`env_hosts`: a child process by default, or a thread) as soon as that episode's turn ends (overlapping the
rest of the generation), and the next turn starts once every step returned or timed out. Limits: `max_turns`
model turns, `max_tokens_per_turn`, `max_total_tokens` completion tokens (model + env), and the engine's
`max_model_len`; hitting one ends the episode with finish_reason "length" (an observation that would not fit is
not appended).

Failures end only their own episode: an env that raises (in its constructor, reset or step), runs past
`step_timeout_s`, or returns something malformed (see `check_step_result`) gives finish_reason "env_error",
`failed` = the reason (the buffer never trains failed samples), `reward` = None and reward_info["env_error"] = 1.
A pause (`stop_event`) interrupts running episodes: finish_reason "interrupted" and `failed` set (a resident
runner's round ends early instead: its episodes come back "aborted" and are continued later).
An overrunning env call counts in `rollout/env_timeouts`. Under process isolation it is killed with its child
process, and the other episodes whose envs lived there fail too ("env process killed"); under thread isolation
it cannot be stopped and is abandoned (daemon thread).

Partial rollouts (`resident=True`, rollout.partial): `run(..., budget=k)` is one round. Each episode gets at most k
new model tokens in it; a turn that reaches the budget is cut there (its env step waits until the turn ends in a
later round), and unfinished episodes come back as finish_reason "aborted" samples (their record so far;
reward_info["turn_open"] says whether the last turn was cut) while the episode (its env object in the env host, its
ids) stays here. `run(carried=samples, budget=...)` continues them, usually under newer weights: new tokens are
stamped with the version that sampled them and keep the engine's log-prob under it. A carried episode this runner
does not hold (its worker died, the job resumed from a checkpoint), holds with another record (the job went back to
a checkpoint) or holds in an env process that is gone (killed, crashed) is rebuilt from its record
(`episode_replay.py`): a fresh env is reset with the same seed and stepped with the recorded actions, the recorded
tokens, log-probs and versions kept, no engine work. Envs must be deterministic given (prompt, seed, actions) for
that (`replayable = True` on the class, checked by the preflight); an env whose replayed observation or reward
differs from the record makes the episode start again from its first turn (reward_info["env_replay_diverged"] = 1).
"""
from __future__ import annotations

import itertools
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any


from gspo_ray.data.prompts import load_tokenizer
from gspo_ray.data.records import FINISH_ABORTED, Prompt, Sample
from gspo_ray.envs.multiturn import (EnvError, check_env, check_observation, check_step_result, decode_action,
                                     is_replayable, numeric_info)
from gspo_ray.rollout.engine import RolloutEngine, SamplingSettings, Segment, mix_seed
from gspo_ray.rollout.env_hosts import EnvCall, EnvProcessError, error_name, make_env_host
from gspo_ray.rollout.episode_replay import recorded_turns
from gspo_ray.rollout.resident import age_idle, holds_record

FINISH_STOP, FINISH_LENGTH, FINISH_ENV_ERROR, FINISH_INTERRUPTED = "stop", "length", "env_error", "interrupted"
INTERRUPTED_REASON = "interrupted mid-episode by a pause (continued later only under rollout.partial)"


@dataclass
class Episode:
    """One episode in progress: the growing completion and its per-token records."""

    prompt: Prompt
    index: int  # sample index within the prompt's group
    eid: int = -1  # the env host's id for this episode's env
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    token_rewards: list[float] = field(default_factory=list)
    turns: int = 0
    turn_starts: list[int] = field(default_factory=list)  # where each model turn starts in ids
    env_tokens: int = 0
    finish: str | None = None  # set when the episode ended
    failed: str | None = None
    info: dict[str, float] = field(default_factory=dict)
    open_turn: bool = False  # resident runners: the last model turn was cut by a round's budget (no env step yet)
    round_tokens: int = 0  # model tokens sampled in the current round
    segments: int = 0  # rounds it took part in
    idle_runs: int = 0  # runs since a round last asked for it

    @property
    def turn_tokens(self) -> int:
        """Model tokens of the open (cut) turn so far; 0 between turns."""
        return len(self.ids) - self.turn_starts[-1] if self.open_turn and self.turn_starts else 0

    @property
    def context(self) -> list[int]:
        """The exact token ids the engine sees next: prompt + everything so far."""
        return self.prompt.prompt_ids + self.ids

    def add_model(self, seg: Segment, version: int) -> None:
        """A turn's tokens, or more of the open turn's (a turn cut by a round goes on in the next one)."""
        self.add_recorded(seg.token_ids, seg.logprobs, [version] * len(seg.token_ids))

    def add_recorded(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        n = len(ids)
        if n and not self.open_turn:  # an explicit boundary: two model turns with an empty observation between
            self.turn_starts.append(len(self.ids))  # them stay two turns
        self.ids += ids
        self.logprobs += logprobs
        self.mask += [1] * n
        self.versions += versions
        self.token_rewards += [0.0] * n
        if not self.open_turn:
            self.turns += 1

    def add_env(self, obs: list[int], version: int | list[int]) -> None:
        """version: the version of the action the observation answers (a list: each token's, from a record)."""
        n = len(obs)
        self.ids += obs
        self.logprobs += [0.0] * n  # not the policy's tokens: never trained, never used
        self.mask += [0] * n
        self.versions += list(version) if isinstance(version, list) else [version] * n
        self.token_rewards += [0.0] * n
        self.env_tokens += n

    def end(self, finish: str, failed: str | None = None) -> None:
        if self.finish is None:
            self.finish, self.failed = finish, failed

    def clear(self) -> None:
        """Back to before its reset (an episode started again from its first turn)."""
        for name in ("ids", "logprobs", "mask", "versions", "token_rewards", "turn_starts"):
            getattr(self, name).clear()
        self.info.clear()  # the replayed steps' info is not this episode's any more
        self.turns = self.env_tokens = 0
        self.open_turn = False

    def to_sample(self, worker_id: int | None) -> Sample:
        failed = self.failed is not None
        info = {**self.info, "turns": float(self.turns), "env_tokens": float(self.env_tokens),
                "env_error": float(self.finish == FINISH_ENV_ERROR)}
        if self.finish is None:  # a resident episode between rounds: its record so far, continued later
            return Sample(prompt_uid=self.prompt.uid, sample_index=self.index,
                          prompt_ids=list(self.prompt.prompt_ids), completion_ids=list(self.ids),
                          logprobs=list(self.logprobs), loss_mask=list(self.mask), versions=list(self.versions),
                          finish_reason=FINISH_ABORTED, token_rewards=list(self.token_rewards),
                          reward_info={**info, "turn_open": float(self.open_turn)}, worker_id=worker_id,
                          turn_starts=list(self.turn_starts), segments=max(self.segments, 1))
        return Sample(prompt_uid=self.prompt.uid, sample_index=self.index, prompt_ids=list(self.prompt.prompt_ids),
                      completion_ids=self.ids, logprobs=self.logprobs, loss_mask=self.mask, versions=self.versions,
                      finish_reason=self.finish or FINISH_LENGTH,
                      reward=None if failed else float(sum(self.token_rewards)),
                      token_rewards=None if failed else self.token_rewards, failed=self.failed, reward_info=info,
                      worker_id=worker_id, turn_starts=list(self.turn_starts), segments=max(self.segments, 1))


class EpisodeRunner:
    """Drives one RolloutEngine through batched multi-turn episodes with one environment class."""

    _run_ids = itertools.count()  # request-id prefix, unique across runners sharing an engine

    def __init__(self, engine: RolloutEngine, env: str | type, tokenizer: Any, *, env_kwargs: dict | None = None,
                 max_turns: int = 4, max_tokens_per_turn: int = 8, max_total_tokens: int = 64,
                 step_timeout_s: float = 5.0, eos_token_ids: list[int] | None = None,
                 isolation: str = "process", num_procs: int = 2, env_host: Any = None, resident: bool = False):
        """env: an env class or its import path (checked now). tokenizer: an HF tokenizer or a model directory;
        it is handed to every env (`cls(tokenizer=..., **env_kwargs)`) and encodes text observations.
        isolation / num_procs: where env code runs (`env_hosts.make_env_host`), built on the first run and kept
        until `close()`; or pass a ready `env_host` (shared across runners, closed by its owner).
        resident: partial rollouts (rounds with a token budget; unfinished episodes kept between them)."""
        if min(max_turns, max_tokens_per_turn, max_total_tokens) < 1 or step_timeout_s <= 0:
            raise ValueError("need max_turns, max_tokens_per_turn, max_total_tokens >= 1 and step_timeout_s > 0")
        self.engine = engine
        self.env_cls = check_env(env)
        if resident and not is_replayable(self.env_cls):  # the preflight refuses such a job before Ray starts
            raise ValueError(f"{self.env_cls.__name__} does not declare `replayable = True`: a resident runner "
                             "rebuilds carried episodes it does not hold by replaying their envs")
        self.env_kwargs = dict(env_kwargs or {})
        if "tokenizer" in self.env_kwargs:
            raise ValueError("rollout.multi_turn.kwargs may not set 'tokenizer': the runner passes the model's")
        self.tokenizer = load_tokenizer(tokenizer)
        self.vocab_size = len(self.tokenizer)
        if eos_token_ids is None:
            eos_token_ids = [self.tokenizer.eos_token_id]
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_turns, self.max_tokens_per_turn = max_turns, max_tokens_per_turn
        self.max_total_tokens, self.step_timeout_s = max_total_tokens, step_timeout_s
        self.isolation, self.num_procs = isolation, num_procs
        self._host, self._owns_host = env_host, env_host is None
        self.resident = resident
        self.live: dict[tuple[str, int], Episode] = {}  # resident: (prompt uid, index) -> its unfinished episode
        self.metrics: dict[str, float] = {}

    @property
    def host(self) -> Any:
        if self._host is None:
            self._host = make_env_host(self.env_cls, self.env_kwargs, self.tokenizer, self.isolation, self.num_procs)
        return self._host

    def close(self) -> None:
        """End the env host this runner built (its processes); resident episodes end with it."""
        if self._host is not None:
            for e in self.live.values():
                self._host.release(e.eid)
        self.live.clear()
        if self._owns_host and self._host is not None:
            self._host.close()
            self._host = None

    @classmethod
    def from_config(cls, engine: RolloutEngine, cfg: Any, tokenizer: Any, env_host: Any = None,
                    resident: bool = False) -> "EpisodeRunner":
        """From a `MultiTurnConfig` (env, kwargs, turn and token limits, step_timeout_s, isolation, num_procs)."""
        return cls(engine, cfg.env, tokenizer, env_kwargs=dict(cfg.kwargs), max_turns=cfg.max_turns,
                   max_tokens_per_turn=cfg.max_tokens_per_turn, max_total_tokens=cfg.max_total_tokens,
                   step_timeout_s=cfg.step_timeout_s, isolation=cfg.isolation, num_procs=cfg.num_procs,
                   env_host=env_host, resident=resident)

    def run(self, prompts: list[Prompt], n: int, sampling: SamplingSettings, *, version: int = 0,
            seed: int | None = None, stop_event: threading.Event | None = None, budget: int | None = None,
            carried: list[Sample] | None = None) -> list[Sample]:
        """n episodes per prompt, in prompt order (prompt 0's n episodes first), as Samples ready for the buffer,
        then (resident runners) one per `carried` sample in its order, continued (finished ones as given; their
        prompts must be among `prompts`, which then start no new episode).

        sampling: temperature / top_p / top_k (its max_new_tokens is not used: the turn and episode limits
        are). seed: per-turn request seeds `mix_seed(seed, crc32(uid), index, turn)` (None: the engine's
        generator; a turn continued in a later round mixes in the tokens it has); envs get
        `mix_seed(seed or 0, crc32(uid))`, the same for every episode of one prompt (and for its replay).
        budget: at most this many new model tokens per episode in this round (None: run each to its end).
        """
        if (budget is not None or carried) and not self.resident:
            raise ValueError("a token budget or carried episodes need a resident runner (rollout.partial)")
        for p in prompts:  # the same check as RolloutEngine.generate, before any env is built
            if not p.prompt_ids or len(p.prompt_ids) >= self.engine.max_model_len:
                raise ValueError(f"prompt {p.uid!r} has {len(p.prompt_ids)} tokens; need 1.."
                                 f"{self.engine.max_model_len - 1} (rollout.max_model_len)")
        start = time.perf_counter()
        run_id = next(self._run_ids)
        self._timeouts, self._env_wait_s = 0, 0.0
        host = self.host
        carried = list(carried or [])
        carried_uids = {s.prompt_uid for s in carried}
        by_uid = {p.uid: p for p in prompts}
        keep: dict[tuple[str, int], Episode] = {}  # carried episodes held here, same record, env still alive
        for s in carried:  # every check before any held episode leaves self.live (an error loses none of them)
            if s.finish_reason != FINISH_ABORTED:
                continue
            held = self.live.get((s.prompt_uid, s.sample_index))
            if held is not None and holds_record(held.prompt.prompt_ids, held.ids, s) and host.alive(held.eid):
                keep[(s.prompt_uid, s.sample_index)] = held
            elif s.prompt_uid not in by_uid:
                raise ValueError(f"carried episode {s.prompt_uid}/{s.sample_index} is not held here and its "
                                 "prompt was not given")
        new = [Episode(p, j, host.new_episode_id()) for p in prompts if p.uid not in carried_uids for j in range(n)]
        order: list[Episode | Sample] = list(new)
        rebuilt: list[tuple[Episode, Sample]] = []
        for s in carried:
            if s.finish_reason != FINISH_ABORTED:
                order.append(s)  # a finished member of a carried group: back as it is
                continue
            key = (s.prompt_uid, s.sample_index)
            e = self.live.pop(key, None)
            if e is not None and keep.get(key) is not e:  # a rewound job (the carried record is the one to
                host.release(e.eid)  # train), or its env's process is gone (killed, crashed): rebuilt
                e = None
            if e is None:  # its prompt is in by_uid (checked above)
                e = Episode(by_uid[s.prompt_uid], s.sample_index, host.new_episode_id())
                rebuilt.append((e, s))
            order.append(e)
        episodes = [x for x in order if isinstance(x, Episode)]
        try:
            self._reset_all(new + [e for e, _ in rebuilt], seed, version)
            for e, s in rebuilt:
                self._replay(e, s, seed, version)
            for e in episodes:
                e.round_tokens = 0
                e.segments += 1
            self._play(episodes, run_id, sampling, version, seed, stop_event, budget)
        except BaseException:
            for e in episodes:
                host.release(e.eid)
            raise
        samples = []
        for x in order:
            if isinstance(x, Sample):
                samples.append(x)
                continue
            if self.resident and x.finish is None:  # open: kept here for a later round
                self.live[(x.prompt.uid, x.index)] = x
            else:
                host.release(x.eid)
                x.end(FINISH_LENGTH)  # still running: out of turns (a no-op for episodes that already ended)
            samples.append(x.to_sample(self.engine.worker_id))
        ran = {id(e) for e in episodes}
        for e in age_idle(list(self.live.values()), lambda e: id(e) in ran):  # their group was dropped
            self.host.release(e.eid)
            del self.live[(e.prompt.uid, e.index)]
        self.metrics = self._metrics(samples, time.perf_counter() - start)
        self.metrics["rollout/env_open_episodes"] = float(sum(s.finish_reason == FINISH_ABORTED for s in samples))
        self.metrics["rollout/env_replayed_episodes"] = float(len(rebuilt))
        return samples

    def _play(self, episodes: list[Episode], run_id: int, sampling: SamplingSettings, version: int,
              seed: int | None, stop_event: threading.Event | None, budget: int | None) -> None:
        """Batched turns until every episode ended, or (a round) spent its budget."""
        for turn in itertools.count():
            live = []
            for e in episodes:
                if e.finish is None and ((e.turns >= self.max_turns and not e.open_turn) or self._turn_cap(e) <= 0):
                    e.end(FINISH_LENGTH)  # out of turns or tokens: ended now, not left open for another round
                if e.finish is None and (budget is None or e.round_tokens < budget):
                    live.append(e)  # others ended, or wait for the next round
            if not live:
                return
            if stop_event is not None and stop_event.is_set():
                if not self.resident:
                    for e in live:
                        e.end(FINISH_INTERRUPTED, INTERRUPTED_REASON)
                return  # resident: the round ends early, its open episodes continue later
            self._turn(live, f"ep{run_id}-t{turn}", sampling, version, seed, stop_event, budget)

    # ---- the environment side ------------------------------------------------------------------------------
    def _reset_all(self, episodes: list[Episode], seed: int | None, version: int) -> None:
        """Build each episode's env and append its first observation; all resets run concurrently."""
        base = 0 if seed is None else seed
        calls = [self.host.reset(e.eid, e.prompt, mix_seed(base, zlib.crc32(e.prompt.uid.encode())))
                 for e in episodes]
        for e, call in zip(episodes, calls):
            failure = self._failure("reset", call, e)
            if failure is None:
                try:
                    obs = check_observation(call.value, self.tokenizer, self.vocab_size, "reset")
                except EnvError as err:
                    failure = f"env reset: {err}"
            if failure is not None:
                e.end(FINISH_ENV_ERROR, failure)
            elif not self._fits(e, obs, need_room=True):
                e.end(FINISH_LENGTH)
            else:
                e.add_env(obs, version)

    def _replay(self, e: Episode, s: Sample, seed: int | None, version: int) -> None:
        """Rebuild a carried episode from its record `s`: its env (already reset, first observation appended) is
        stepped with each recorded action; the recorded tokens, log-probs and versions are kept. An observation
        or reward that differs from the record (an env not deterministic under replay) starts the episode again
        from its first turn; an env that fails on replay ends the episode (env_error)."""
        turns, opened = recorded_turns(s)
        diverged = e.finish is None and (e.ids != s.completion_ids[:len(e.ids)] or (
            bool(turns) and turns[0].start != len(e.ids)))
        if not diverged and e.finish is None:  # the first observation answered no action of this round: it keeps
            e.versions = list(s.versions[:len(e.ids)])  # the record's versions, so the rebuilt record is the record
        for k, t in enumerate(turns):
            if diverged or e.finish is not None:
                break
            e.add_recorded(s.completion_ids[t.start:t.end], s.logprobs[t.start:t.end], s.versions[t.start:t.end])
            if k == len(turns) - 1 and opened:
                e.open_turn = True  # cut by a round: the engine continues it
                break
            before = len(e.ids)
            action = s.completion_ids[t.start:t.end]
            self._apply_step(e, self.host.step(e.eid, action, decode_action(self.tokenizer, action,
                                                                            self.eos_token_ids)[0]),
                             s.versions[t.end - 1])  # env tokens: the version of the action they answer
            recorded_reward = None if s.token_rewards is None else s.token_rewards[t.end - 1]
            diverged = (e.finish is not None and e.finish != FINISH_ENV_ERROR) or (e.finish is None and (
                e.ids[before:] != s.completion_ids[t.end:t.next]
                or (recorded_reward is not None and e.token_rewards[t.end - 1] != recorded_reward)))
        if diverged and (e.finish is None or e.finish != FINISH_ENV_ERROR):
            self.host.release(e.eid)
            e.clear()
            e.finish, e.failed = None, None
            e.eid = self.host.new_episode_id()
            self._reset_all([e], seed, version)
        e.info["env_replayed"] = 1.0
        e.info["env_replay_diverged"] = float(diverged)
        e.segments = s.segments

    def _failure(self, where: str, call: EnvCall, e: Episode) -> str | None:
        """The reason an env call failed (timeout, exception, lost process), or None when it returned in time."""
        waited = time.monotonic()
        done = call.wait(self.step_timeout_s)
        self._env_wait_s += time.monotonic() - waited
        if not done:
            self._timeouts += 1
            reason = f"env {where} timed out after {self.step_timeout_s:g}s"
            self.host.abandon(call, f"episode {e.prompt.uid}/{e.index}: {reason}")
            return reason
        if isinstance(call.error, EnvProcessError):
            return f"env {where} failed: {call.error}"
        if call.error is not None:
            return f"env {where} raised {error_name(call.error)}: {call.error}"
        return None

    def _fits(self, e: Episode, obs: list[int], need_room: bool) -> bool:
        """Whether `obs` fits the episode's token limits (need_room: and leaves room for one more model token)."""
        extra = 1 if need_room else 0
        return (len(e.ids) + len(obs) + extra <= self.max_total_tokens
                and len(e.context) + len(obs) + extra <= self.engine.max_model_len)

    def _apply_step(self, e: Episode, call: EnvCall, version: int) -> None:
        """Credit the turn's reward to its last model token, append the observation, or end the episode."""
        failure = self._failure("step", call, e)
        if failure is None:
            try:
                obs, reward, done, info = check_step_result(call.value, self.tokenizer, self.vocab_size)
            except EnvError as err:
                failure = f"env step: {err}"
        if failure is not None:
            e.end(FINISH_ENV_ERROR, failure)
            return
        e.token_rewards[-1] += reward
        e.info.update(numeric_info(info))
        if done:
            if self._fits(e, obs, need_room=False):  # the closing observation is kept for the transcript
                e.add_env(obs, version)
            e.end(FINISH_STOP)
        elif self._fits(e, obs, need_room=True):
            e.add_env(obs, version)
        else:
            e.end(FINISH_LENGTH)

    # ---- the model side ------------------------------------------------------------------------------------
    def _turn(self, live: list[Episode], prefix: str, sampling: SamplingSettings, version: int,
              seed: int | None, stop_event: threading.Event | None, budget: int | None = None) -> None:
        """One model turn for every live episode (one batched engine run), then their env steps. A turn cut by the
        round's budget (or, resident, by a pause) stays open: no env step until it ends in a later round."""
        requests, owners, calls, cut = {}, {}, {}, set()
        for k, e in enumerate(live):
            cap = self._turn_cap(e)
            if cap <= 0:
                e.end(FINISH_LENGTH)
                continue
            rid = f"{prefix}-{k}"  # unique even when a batch repeats a prompt uid
            if budget is not None and budget - e.round_tokens < cap:
                cap = budget - e.round_tokens
                cut.add(rid)  # reaching this cap ends the round's share, not the turn
            turn = e.turns - 1 if e.open_turn else e.turns
            rseed = None if seed is None else mix_seed(seed, zlib.crc32(e.prompt.uid.encode()), e.index, turn)
            if rseed is not None and e.turn_tokens:  # a continued turn: a fresh draw, not the turn's first tokens
                rseed = mix_seed(rseed, e.turn_tokens)
            requests[rid], owners[rid] = (e.context, self.engine.sampling_params(sampling, cap, rseed)), e
        done_before = {rid: e.ids[len(e.ids) - e.turn_tokens:] for rid, e in owners.items()}

        def turn_done(rid: str, seg: Segment) -> None:  # start the env step while others still generate
            if seg.finish_reason == "abort" or not seg.token_ids or (seg.finish_reason == "length" and rid in cut):
                return
            action = done_before[rid] + list(seg.token_ids)
            text, _ = decode_action(self.tokenizer, action, self.eos_token_ids)
            calls[rid] = self.host.step(owners[rid].eid, action, text)

        segments = self.engine.run(requests, turn_done, stop_event) if requests else {}
        paused = stop_event is not None and stop_event.is_set()
        for rid, seg in segments.items():
            e = owners[rid]
            held = rid not in calls and self.resident and (
                rid in cut and seg.finish_reason == "length" or seg.finish_reason == "abort" and paused)
            if held and not seg.token_ids:
                continue  # nothing sampled: the turn starts in a later round
            e.add_model(seg, version)
            e.round_tokens += len(seg.token_ids)
            if rid in calls:
                e.open_turn = False
                self._apply_step(e, calls[rid], version)
            elif held:
                e.open_turn = True
            else:  # stopped by a pause before its turn ended
                e.end(FINISH_INTERRUPTED, INTERRUPTED_REASON)

    def _turn_cap(self, e: Episode) -> int:
        """Model tokens the episode's current turn may still take (turn, episode and context limits)."""
        return min(self.max_tokens_per_turn - e.turn_tokens, self.max_total_tokens - len(e.ids),
                   self.engine.max_model_len - len(e.context))

    def _metrics(self, samples: list[Sample], seconds: float) -> dict[str, float]:
        model = sum(sum(s.loss_mask) for s in samples)
        env = sum(s.num_tokens for s in samples) - model
        n = max(len(samples), 1)
        return {"rollout/gen_s": seconds, "rollout/tokens": float(model), "rollout/env_tokens": float(env),
                "rollout/tokens_per_s": model / seconds if seconds > 0 else 0.0,
                "rollout/samples": float(len(samples)),
                "rollout/turns_mean": sum(s.reward_info["turns"] for s in samples) / n,
                "rollout/env_errors": float(sum(s.finish_reason == FINISH_ENV_ERROR for s in samples)),
                "rollout/env_timeouts": float(self._timeouts), "rollout/env_wait_s": self._env_wait_s,
                "rollout/env_procs_killed": float(self.host.killed),
                "rollout/interrupted": float(sum(s.finish_reason == FINISH_INTERRUPTED for s in samples)),
                "rollout/truncated": float(sum(s.finish_reason == FINISH_LENGTH for s in samples))}


def run_episodes(engine: RolloutEngine, prompts: list[Prompt], n: int, cfg: Any, tokenizer: Any,
                 sampling: SamplingSettings, *, version: int = 0, seed: int | None = None,
                 stop_event: threading.Event | None = None) -> tuple[list[Sample], dict[str, float]]:
    """One-shot `EpisodeRunner.from_config(engine, cfg, tokenizer).run(...)`; returns (samples, metrics)."""
    runner = EpisodeRunner.from_config(engine, cfg, tokenizer)
    try:
        samples = runner.run(prompts, n, sampling, version=version, seed=seed, stop_event=stop_event)
    finally:
        runner.close()
    return samples, runner.metrics
