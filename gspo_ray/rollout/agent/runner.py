"""Agent episodes on a RolloutEngine: the user's agent calls the endpoint, the engine answers, tokens are recorded.

    runner = AgentRunner.from_config(engine, cfg.rollout.agent, tokenizer, sampling, resident=False)
    samples = runner.run(prompts, n=8, version=3, seed=0)        # Samples ready for the buffer
    runner.close()

This thread owns the engine: it starts each episode in an agent process, then loops, taking events from the
endpoint's queue: model calls (gathered for `batch_window_s` after the first, then run as one engine batch),
agents' results, dead agent processes; and enforcing each episode's wall clock. An episode's samples are
`Sample`s like multi-turn episodes' (gspo_ray/rollout/episodes.py): model tokens loss-masked 1 with the engine's
log-probs and the policy version each was sampled by, rendered tokens 0. One Sample per episode (a group holds n):
after a history split it is the part from the last split on; the parts before are not trained yet, and counted
(`rollout/agent_history_splits`, `rollout/agent_split_tokens`). The reward is the agent's return value (a float, or
a dict with "reward" whose other numeric entries land in reward_info as "agent/<key>"), on the last model token of
each sample in `token_rewards`. An episode that failed (the agent raised, timed out, returned no reward, sent a
refused request, or its process died) has `failed` set, finish_reason "agent_error", and no reward.

Partial rollouts (`resident=True`, rollout.partial): `run(..., budget=k)` is one round. Each episode of the round
gets at most k new model tokens; a call that reaches the budget is cut there and held, unanswered (its agent
simply waits on its HTTP call), and the round ends when each of its episodes has either reported or holds such a
call. Unfinished episodes come back as finish_reason "aborted" samples (their record so far, the held call's
rendered ids and tokens included) and stay alive in this worker: `run(carried=samples, budget=...)` continues them
(a later round, usually under newer weights), each new token stamped with the version it was sampled by, so one
call's reply can span several policy versions as a single-turn partial completion does. A carried episode this
runner does not hold (its worker died; the job resumed from a checkpoint) is started again and answered from its
record until the agent diverges (`replay.py`); one it holds whose record differs from the carried one (the
coordinator went back to a checkpoint) is ended and replayed the same way. An episode's wall clock runs only
while a round works on it: it stops while its call is held (the agent's process has no clock of its own then;
the runner cancels the agent at its deadline).
"""
from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any

from gspo_ray.data.records import FINISH_ABORTED, Prompt, Sample
from gspo_ray.rollout.agent.agent_procs import AgentProcs
from gspo_ray.rollout.agent.protocol import agent_outcome, resolve_chat_template
from gspo_ray.rollout.agent.replay import ReplayRecord
from gspo_ray.rollout.agent.requests import SERVED_MODEL
from gspo_ray.rollout.agent.server import (FINISH_AGENT_ERROR, FINISH_INTERRUPTED, FINISH_LENGTH, FINISH_STOP,
                                           AgentEndpoint, AgentEpisode, GenerationRequest)
from gspo_ray.rollout.agent.tool_calls import load_tool_parser
from gspo_ray.rollout.agent.transcript import ChatRenderer, EpisodeTranscript, SampleRecord
from gspo_ray.rollout.engine import RolloutEngine, SamplingSettings, Segment, mix_seed
from gspo_ray.rollout.resident import age_idle, holds_record

log = logging.getLogger(__name__)
BLOCKED_GRACE_S = 2.0  # past an episode's wall clock, how long its process has to report before it is killed
START_TIMEOUT_S = 120.0  # a fresh agent process importing openai and the agent; an episode's clock starts after


@dataclass
class LiveEpisode:
    """An episode between its start and its agent's report; resident runners keep it across rounds."""

    prompt: Prompt
    index: int
    episode: AgentEpisode
    child: int  # the serial of the agent process that hosts it
    child_index: int  # that process's place in AgentProcs.children
    clock_left: float  # seconds of its wall clock left (counted only while a round it takes part in runs)
    started: bool = False  # its agent process reported the episode started (its wall clock runs)
    reported: bool = False  # the agent returned, raised, timed out, or lost its process
    outcome: tuple[float, dict] | None = None  # (reward, extras) of an agent that returned
    held: GenerationRequest | None = None  # a call waiting for the next round (cut by, or queued past, the budget)
    round_tokens: int = 0  # model tokens sampled in the current round
    segments: int = 0  # rounds it took part in
    idle_runs: int = 0  # runs since a round last asked for it
    deadline: float = math.inf  # monotonic time its wall clock runs out, during a round
    cancelled: bool = False  # its agent was told to stop (wall clock)
    restarted: bool = False  # started again from a carried record this runner did not hold
    rewound: bool = False  # ... because the episode it held had another record


class AgentRunner:
    """Runs batches (or partial-rollout rounds) of agent episodes against one engine (see the module docstring)."""

    _run_ids = itertools.count()

    def __init__(self, engine: RolloutEngine, cfg: Any, tokenizer: Any, sampling: SamplingSettings,
                 eos_token_ids: list[int] | None = None, resident: bool = False):
        """cfg: an `AgentConfig`; tokenizer: the model's HF tokenizer; sampling: the job's (temperature, top_p).
        resident: partial rollouts (rounds with a token budget; unfinished episodes kept between them)."""
        self.engine, self.cfg, self.sampling, self.resident = engine, cfg, sampling, resident
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids or [tokenizer.eos_token_id])
        self.renderer = ChatRenderer(tokenizer, resolve_chat_template(cfg.chat_template))
        self.parser_cls = load_tool_parser(cfg.tool_parser, tokenizer)
        self.endpoint = AgentEndpoint(self.renderer, self.parser_cls, self.eos_token_ids, engine.max_model_len,
                                      sampling.temperature, sampling.top_p)
        self.procs: AgentProcs | None = None
        self.live: dict[tuple[str, int], LiveEpisode] = {}  # (prompt uid, episode index) -> its episode
        self._by_id: dict[str, LiveEpisode] = {}  # endpoint episode id -> the same
        self._episode_ids = itertools.count()
        self._spread = itertools.count()
        self.engine_batches = self.engine_calls = 0  # engine batches run and the model calls in them, all time
        self.metrics: dict[str, float] = {}

    @classmethod
    def from_config(cls, engine: RolloutEngine, cfg: Any, tokenizer: Any, sampling: SamplingSettings,
                    resident: bool = False):
        return cls(engine, cfg, tokenizer, sampling, resident=resident)

    def close(self) -> None:
        """Stop the endpoint and the agent processes (resident episodes end with them)."""
        for le in self._by_id.values():  # held calls answered first: their handlers end before the server stops
            if le.held is not None:
                le.held.future.set_result((Segment(finish_reason="abort"), [], None))
                le.held = None
        if self.procs is not None:
            self.procs.close()
            self.procs = None
        self.endpoint.stop()
        self.live.clear()
        self._by_id.clear()

    # ---- a batch, or one round ------------------------------------------------------------------------------
    def run(self, prompts: list[Prompt], n: int, *, version: int = 0, seed: int | None = None,
            stop_event: threading.Event | None = None, budget: int | None = None,
            carried: list[Sample] | None = None) -> list[Sample]:
        """n new episodes per prompt, then the `carried` samples' episodes continued (resident runners; their
        prompts must be among `prompts`, which then start no new episode). Returns the new episodes' samples
        grouped by prompt (episode 0's first), then one per carried sample in its order (finished ones as given).
        budget: at most this many new model tokens per episode in this round (None: run each to its end).
        seed: each call's seed is `mix_seed(seed, crc32(uid), episode index, call index)`, as multi-turn episodes
        seed their turns (a call continued in a later round: mixed with the tokens it has)."""
        if (budget is not None or carried) and not self.resident:
            raise ValueError("a token budget or carried episodes need a resident runner (rollout.partial)")
        start = time.perf_counter()
        if self.endpoint.url is None:
            self.endpoint.start()
        if self.procs is None:
            self.procs = AgentProcs(self.cfg.fn, dict(self.cfg.kwargs), self.cfg.num_procs, self.endpoint.requests)
        self._drain(version)  # reports and calls that came while no round ran
        self.procs.replace_dead()
        killed_before, refused_before = self.procs.killed, self.endpoint.refused
        batches_before, calls_before = self.engine_batches, self.engine_calls
        carried = list(carried or [])
        carried_uids = {s.prompt_uid for s in carried}
        by_uid = {p.uid: p for p in prompts}
        fresh = [p for p in prompts if p.uid not in carried_uids]
        order: list[LiveEpisode | Sample] = []  # what this call returns, in order
        new: list[LiveEpisode] = []
        restarted = 0
        for p in fresh:
            for j in range(n):
                le = self._new_episode(p, j, seed)
                new.append(le)
                order.append(le)
        for s in carried:
            if s.finish_reason != FINISH_ABORTED:
                order.append(s)  # a finished member of a carried group: back as it is
                continue
            le = self.live.get((s.prompt_uid, s.sample_index))
            rewound = le is not None and not self._holds(le, s)
            if rewound:  # its record is not the carried one (a rewound job, or its agent process died)
                log.warning("agent episode %s/%d: the live record (%s) is not the carried one (%s); started again",
                            s.prompt_uid, s.sample_index, self._record_shape(le), (len(s.prompt_ids),
                                                                                len(s.completion_ids)))
                self._end(le, FINISH_INTERRUPTED, "rewound to an earlier record", cancel=True)
                self._forget(le)
                le = None
            if le is None:
                if s.prompt_uid not in by_uid:
                    raise ValueError(f"carried sample {s.prompt_uid}/{s.sample_index} is not held here and its "
                                     "prompt was not given")
                le = self._new_episode(by_uid[s.prompt_uid], s.sample_index, seed)
                le.episode.replay = ReplayRecord.from_sample(s) if s.completion_ids else None
                le.segments, le.restarted, le.rewound = s.segments, True, rewound
                new.append(le)
                restarted += 1
            order.append(le)
        episodes = [x for x in order if isinstance(x, LiveEpisode)]
        try:
            for le in new:
                self._start_agent(le)
            self._round(episodes, version, budget, stop_event)
        finally:
            self._drain(version)
        samples, finished = [], []
        for x in order:
            if isinstance(x, Sample):
                samples.append(x)
            else:
                done = x.reported or not self.resident
                samples.append(self._episode_sample(x, final=done))
                if done:
                    finished.append(x)
        for le in finished:
            self._forget(le)
        self._evict_idle(episodes)
        self.metrics = self._metrics(samples, episodes, time.perf_counter() - start, killed_before, refused_before,
                                     restarted)
        # how the calls were gathered: engine batches this run, and the model calls they served
        self.metrics["rollout/agent_engine_batches"] = float(self.engine_batches - batches_before)
        self.metrics["rollout/agent_engine_calls"] = float(self.engine_calls - calls_before)
        return samples

    def _new_episode(self, p: Prompt, j: int, seed: int | None) -> LiveEpisode:
        ep = AgentEpisode(f"e{next(self._episode_ids)}", EpisodeTranscript(self.renderer, self.eos_token_ids),
                          None if seed is None else (seed, zlib.crc32(p.uid.encode()), j),
                          self.cfg.max_turns, self.cfg.max_total_tokens)
        child = next(self._spread) % len(self.procs.children)  # a batch's episodes spread over the processes
        le = LiveEpisode(p, j, ep, self.procs.serial(child), child, clock_left=self.cfg.episode_timeout_s)
        self.live[(p.uid, j)] = le
        self._by_id[ep.id] = le
        self.endpoint.episodes[ep.id] = ep
        return le

    def _start_agent(self, le: LiveEpisode) -> None:
        p = le.prompt
        task = {"uid": p.uid, "index": le.index, "prompt": p.text if p.text is not None else
                self.renderer.decode(p.prompt_ids), "reference": p.reference, "meta": dict(p.meta),
                "model": SERVED_MODEL}
        # resident: no wall clock inside the agent's process (a held call waits across rounds); this runner ends
        # the episode at its deadline (`_check_deadlines`), counting only the rounds it runs in
        self.procs.start_episode(le.child_index, le.episode.id, self.endpoint.episode_url(le.episode),
                                 le.episode.key, task, None if self.resident else self.cfg.episode_timeout_s)

    def _forget(self, le: LiveEpisode) -> None:
        if self.live.get((le.prompt.uid, le.index)) is le:  # a batch that repeats a prompt shares its keys
            del self.live[(le.prompt.uid, le.index)]
        self._by_id.pop(le.episode.id, None)
        self.endpoint.episodes.pop(le.episode.id, None)

    def _evict_idle(self, ran: list[LiveEpisode]) -> None:
        """Resident episodes no round asked for in resident.MAX_IDLE_RUNS runs are ended (`age_idle`)."""
        ids = {le.episode.id for le in ran}
        for le in age_idle(list(self._by_id.values()), lambda le: le.episode.id in ids):
            self._end(le, FINISH_INTERRUPTED, "no round continued it", cancel=True)
            self._forget(le)

    def _record_shape(self, le: LiveEpisode) -> tuple:
        mine = self._episode_sample(le, final=False)
        return len(mine.prompt_ids), len(mine.completion_ids), le.reported, le.episode.finish, le.held is not None

    def _holds(self, le: LiveEpisode, s: Sample) -> bool:
        """Whether a live episode's record is the carried sample's (same prompt and tokens)."""
        mine = self._episode_sample(le, final=False)
        return holds_record(mine.prompt_ids, mine.completion_ids, s)

    def _end(self, le: LiveEpisode, finish: str, why: str | None, cancel: bool = False) -> None:
        """End an episode's recording; its held call is answered as aborted; `cancel`: its agent is told to stop."""
        le.episode.end(finish, why)
        if le.held is not None:
            le.held.future.set_result((Segment(finish_reason="abort"), [], None))
            le.held = None
        if cancel and not le.reported and self.procs is not None:
            self.procs.cancel(le.child, le.episode.id, why or finish)
            le.cancelled = True

    # ---- the event loop ------------------------------------------------------------------------------------
    def _round(self, episodes: list[LiveEpisode], version: int, budget: int | None, stop_event) -> None:
        """Until each episode's agent reported (returned, raised, timed out, or lost its process), or, with a
        budget, holds a call past it: a limit ends an episode's recording at once, and the agent may still
        return its reward."""
        now = time.monotonic()
        ready = []
        for le in episodes:
            le.round_tokens = 0
            le.segments += 1
            le.deadline = now + le.clock_left + (0.0 if le.started else START_TIMEOUT_S)
            if le.held is not None:  # continued now, under this round's weights
                ready.append(le.held)
                le.held = None
        events = self.endpoint.requests
        try:
            while not all(le.reported or le.held is not None for le in episodes):
                if stop_event is not None and stop_event.is_set():
                    if not self.resident:
                        for le in episodes:
                            le.episode.end(FINISH_INTERRUPTED, "interrupted mid-episode by a pause (outside "
                                                               "partial rollouts, agent episodes are not continued)")
                    break
                batch = [r for r in ready]
                ready = []
                if not batch:
                    try:
                        first = events.get(timeout=0.05)
                    except queue.Empty:
                        self._check_deadlines(episodes)
                        continue
                    for event in self._gather(first):
                        if event[0] == "generate":
                            batch.append(event[1])
                        else:
                            self._on_agent_event(event)
                if batch:
                    self._generate(batch, version, budget, stop_event)
                self._check_deadlines(episodes)
        finally:
            now = time.monotonic()
            for le in episodes:
                if le.started and le.deadline != math.inf:  # a held episode's clock stopped when it was held
                    le.clock_left = max(le.deadline - now, 0.0)
                le.deadline = math.inf

    def _drain(self, version: int) -> None:
        """Take what queued while no round ran: agents' reports (recorded), calls (held for a resident episode's
        next round; else answered as aborted: a pause ended their batch)."""
        while True:
            try:
                event = self.endpoint.requests.get_nowait()
            except queue.Empty:
                return
            if event[0] != "generate":
                self._on_agent_event(event)
                continue
            req = event[1]
            le = self._by_id.get(req.episode.id)
            if self.resident and le is not None and req.episode.finish is None:
                self._hold(le, req, version)
            else:
                req.future.set_result((Segment(finish_reason="abort"), [], None))

    def _hold(self, le: LiveEpisode, req: GenerationRequest, version: int) -> None:
        """Keep a call for the next round. The episode's wall clock stops: it waits on the others, not on its
        agent."""
        if req.rendered_version is None:
            req.rendered_version = version
        le.held = req
        if le.started and le.deadline != math.inf:
            le.clock_left, le.deadline = max(le.deadline - time.monotonic(), 0.0), math.inf

    def _gather(self, first: tuple) -> list[tuple]:
        """`first` plus the events that arrive within the batch window (model calls of other episodes)."""
        out, end = [first], time.monotonic() + self.cfg.batch_window_s
        while True:
            left = end - time.monotonic()
            try:
                out.append(self.endpoint.requests.get(timeout=left) if left > 0 else
                           self.endpoint.requests.get_nowait())
            except queue.Empty:
                return out

    def _generate(self, batch: list[GenerationRequest], version: int, budget: int | None, stop_event) -> None:
        """One engine batch of calls; each is answered when its reply is complete, or held (cut by the round's
        budget, or by a pause in a resident runner) with what it produced so far."""
        from vllm import SamplingParams

        s = self.sampling
        requests, calls = {}, {}
        for r in batch:
            le = self._by_id.get(r.episode.id)
            if r.episode.finish is not None or le is None:  # ended while queued: nothing to generate
                r.future.set_result((Segment(finish_reason="abort"), [], None))
                continue
            if r.rendered_version is None:
                r.rendered_version = version  # the version its rendered ids are stamped with
            cap = r.max_tokens - len(r.done_ids)
            if budget is not None:
                cap = min(cap, budget - le.round_tokens)
            if cap <= 0:  # this episode's budget of the round is spent: the call waits for the next round
                self._hold(le, r, version)
                continue
            seed = r.seed if r.seed is None or not r.done_ids else mix_seed(r.seed, len(r.done_ids))
            rid = f"{r.episode.id}-c{r.episode.transcript.calls}-t{len(r.done_ids)}"
            requests[rid] = (r.context + r.done_ids, SamplingParams(
                n=1, logprobs=0, max_tokens=cap, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=seed,
                stop_token_ids=r.stop_token_ids or None))
            calls[rid] = (r, le)
        if not requests:
            return
        self.engine_batches += 1
        self.engine_calls += len(requests)
        try:
            segments = self.engine.run(requests, None, stop_event)
        except BaseException as e:
            for r, _ in calls.values():
                r.future.set_exception(e)
            raise
        for rid, (r, le) in calls.items():
            seg = segments[rid]
            r.done_ids += seg.token_ids
            r.done_logprobs += seg.logprobs
            r.done_versions += [version] * len(seg.token_ids)
            le.round_tokens += len(seg.token_ids)
            complete = seg.finish_reason == "stop" or len(r.done_ids) >= r.max_tokens
            if seg.finish_reason == "abort" and not self.resident:  # a pause: the endpoint ends the episode
                r.future.set_result((Segment(finish_reason="abort"), [], None))
            elif complete:
                r.future.set_result((Segment(list(r.done_ids), list(r.done_logprobs), seg.finish_reason),
                                     list(r.done_versions), r.rendered_version))
            else:  # cut by the round's budget (or a pause): continued in a later round
                self._hold(le, r, version)

    def _on_agent_event(self, event: tuple) -> None:
        kind = event[0]
        if kind == "agent_proc_dead":
            serial, why = event[1], event[2]
            for le in list(self._by_id.values()):
                if le.child == serial and not le.reported:
                    le.reported = True
                    self._end(le, FINISH_AGENT_ERROR, why)
            return
        if kind == "agent_started":
            le = self._by_id.get(event[1])
            if le is not None and not le.started:
                le.started = True
                if le.deadline != math.inf:  # its wall clock starts now, not while its process loaded
                    le.deadline = time.monotonic() + le.clock_left
                else:  # held before this report came: what it kept included the start-up allowance
                    le.clock_left = min(le.clock_left, self.cfg.episode_timeout_s)
            return
        le = self._by_id.get(event[1])
        if le is None or le.reported:  # an episode of an earlier batch, reporting late
            return
        le.reported = True
        if kind == "agent_error":
            self._end(le, FINISH_AGENT_ERROR, event[2])
            return
        try:
            le.outcome = agent_outcome(event[2])
        except ValueError as e:
            self._end(le, FINISH_AGENT_ERROR, str(e))
            return
        self._end(le, FINISH_STOP, None)

    def _check_deadlines(self, episodes: list[LiveEpisode]) -> None:
        """A resident episode past its wall clock is ended and its agent told to stop; one whose agent still has
        not reported after the grace has blocked its process: the process is killed (its episodes end)."""
        now = time.monotonic()
        timeout = self.cfg.episode_timeout_s
        for le in episodes:
            if le.reported or now <= le.deadline:
                continue
            if self.resident and not le.cancelled:
                self._end(le, FINISH_AGENT_ERROR, f"agent timed out after {timeout:g}s", cancel=True)
            if now > le.deadline + BLOCKED_GRACE_S:
                le.reported = True
                why = (f"agent blocked its process past the episode's {timeout:g}s wall clock "
                       f"(episode {le.episode.id}); the process was killed")
                self._end(le, FINISH_AGENT_ERROR, f"agent timed out after {timeout:g}s (blocked its process, which "
                                                  "was killed)")
                self.procs.kill(le.child, why)

    # ---- samples and metrics -------------------------------------------------------------------------------
    def _episode_sample(self, le: LiveEpisode, final: bool) -> Sample:
        """The episode's Sample: final (the agent reported, or a batch ended) or its record so far, "aborted"
        (a resident episode between rounds: its held call's rendered ids and tokens included)."""
        p, ep = le.prompt, le.episode
        r = ep.transcript.samples[-1] if ep.transcript.samples else SampleRecord(list(p.prompt_ids))
        # the part after the last history split is the episode's sample (a group holds n, one per episode);
        # the parts before it are left out of training and counted (rollout/agent_split_tokens)
        info = {"turns": float(r.turns), "env_tokens": float(len(r.ids) - sum(r.mask)),
                "agent_history_splits": float(ep.transcript.splits),  # summed by the pool: the step's splits
                "agent_error": float(ep.finish == FINISH_AGENT_ERROR)}
        if le.restarted:  # started again from a record (a resumed job, a dead worker): what the record answered
            info.update({"agent_restarted": 1.0, "agent_replayed_calls": float(ep.replayed_calls),
                         "agent_replay_diverged": float(ep.replay_diverged), "agent_rewound": float(le.rewound)})
        if not final:
            prompt_ids, ids, logprobs = list(r.prompt_ids), list(r.ids), list(r.logprobs)
            mask, versions, starts = list(r.mask), list(r.versions), list(r.turn_starts)
            h = le.held
            if h is not None:
                if h.new_sample:
                    prompt_ids, ids, logprobs, mask, versions, starts = list(h.context), [], [], [], [], []
                else:
                    ids, logprobs = ids + h.rendered, logprobs + [0.0] * len(h.rendered)
                    mask, versions = mask + [0] * len(h.rendered), versions + [h.rendered_version] * len(h.rendered)
                if h.done_ids:
                    starts.append(len(ids))
                ids, logprobs = ids + h.done_ids, logprobs + h.done_logprobs
                mask, versions = mask + [1] * len(h.done_ids), versions + h.done_versions
            return Sample(prompt_uid=p.uid, sample_index=le.index, prompt_ids=prompt_ids, completion_ids=ids,
                          logprobs=logprobs, loss_mask=mask, versions=versions, finish_reason=FINISH_ABORTED,
                          reward_info={}, worker_id=self.engine.worker_id, turn_starts=starts,
                          segments=max(le.segments, 1))
        reward, extras = le.outcome or (None, {})
        failed = ep.failed
        if ep.failed is None and reward is None:
            failed = f"the episode ended ({ep.finish}) without the agent's reward"
        token_rewards = None
        if failed is None:  # the reward on the last model token (sequence and reward-to-go paths both see it)
            token_rewards = [0.0] * len(r.ids)
            if r.ids:
                last_model = max((t for t, m in enumerate(r.mask) if m), default=len(r.ids) - 1)
                token_rewards[last_model] = reward
        return Sample(prompt_uid=p.uid, sample_index=le.index, prompt_ids=list(r.prompt_ids),
                      completion_ids=list(r.ids), logprobs=list(r.logprobs), loss_mask=list(r.mask),
                      versions=list(r.versions), finish_reason=ep.finish or FINISH_LENGTH,
                      reward=None if failed else reward, token_rewards=token_rewards, failed=failed,
                      reward_info={**extras, **info}, worker_id=self.engine.worker_id,
                      turn_starts=list(r.turn_starts), segments=max(le.segments, 1))

    def _metrics(self, samples, episodes, seconds, killed_before, refused_before, restarted) -> dict[str, float]:
        model = sum(sum(s.loss_mask) for s in samples)
        eps = [le.episode for le in episodes]
        return {"rollout/gen_s": seconds, "rollout/tokens": float(model),
                "rollout/env_tokens": float(sum(s.num_tokens for s in samples) - model),
                "rollout/tokens_per_s": model / seconds if seconds > 0 else 0.0,
                "rollout/samples": float(len(samples)), "rollout/episodes": float(len(eps)),
                "rollout/turns_mean": sum(ep.transcript.calls for ep in eps) / max(len(eps), 1),
                "rollout/agent_errors": float(sum(ep.finish == FINISH_AGENT_ERROR for ep in eps)),
                "rollout/agent_history_splits": float(sum(ep.transcript.splits for ep in eps)),
                "rollout/agent_split_tokens": float(sum(sum(len(r.ids) for r in ep.transcript.samples[:-1])
                                                        for ep in eps)),
                "rollout/agent_refused": float(self.endpoint.refused - refused_before),
                "rollout/agent_procs_killed": float(self.procs.killed - killed_before),
                "rollout/interrupted": float(sum(ep.finish == FINISH_INTERRUPTED for ep in eps)),
                "rollout/truncated": float(sum(ep.finish == FINISH_LENGTH for ep in eps)),
                # partial rollouts: episodes left open for a later round, and resumed ones answered from records
                "rollout/agent_open_episodes": float(sum(s.finish_reason == FINISH_ABORTED for s in samples)),
                "rollout/agent_restarted": float(restarted),
                "rollout/agent_replayed_calls": float(sum(ep.replayed_calls for ep in eps)),
                "rollout/agent_replay_diverged": float(sum(ep.replay_diverged for ep in eps))}
