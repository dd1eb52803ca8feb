"""Agent episodes on a RolloutEngine: the user's agent calls the endpoint, the engine answers, tokens are recorded.

    runner = AgentRunner.from_config(engine, cfg.rollout.agent, tokenizer, sampling)
    samples = runner.run(prompts, n=8, version=3, seed=0)        # Samples ready for the buffer
    runner.close()

This thread owns the engine: it starts each episode in an agent process, then loops, taking events from the
endpoint's queue: model calls (gathered for `batch_window_s` after the first, then run as one engine batch),
agents' results, dead agent processes; and enforcing each episode's wall clock. An episode's samples are
`Sample`s like multi-turn episodes' (gspo_ray/rollout/episodes.py): model tokens loss-masked 1 with the engine's
log-probs and the call's policy version, rendered tokens 0. One Sample per episode (a group holds n): after a
history split it is the part from the last split on; the parts before are not trained yet, and counted
(`rollout/agent_history_splits`, `rollout/agent_split_tokens`). The reward is the agent's return value (a float, or a dict
with "reward" whose other numeric entries land in reward_info as "agent/<key>"), on the last model token of
each sample in `token_rewards`. An episode that failed (the agent raised, timed out, returned no reward, sent a
refused request, or its process died) has `failed` set, finish_reason "agent_error", and no reward.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
import zlib
from typing import Any

from gspo_ray.data.records import Prompt, Sample
from gspo_ray.rollout.agent.agent_procs import AgentProcs
from gspo_ray.rollout.agent.protocol import agent_outcome, resolve_chat_template
from gspo_ray.rollout.agent.requests import SERVED_MODEL
from gspo_ray.rollout.agent.server import (FINISH_AGENT_ERROR, FINISH_INTERRUPTED, FINISH_LENGTH, FINISH_STOP,
                                           AgentEndpoint, AgentEpisode, GenerationRequest)
from gspo_ray.rollout.agent.tool_calls import load_tool_parser
from gspo_ray.rollout.agent.transcript import ChatRenderer, EpisodeTranscript, SampleRecord
from gspo_ray.rollout.engine import RolloutEngine, SamplingSettings, Segment

BLOCKED_GRACE_S = 2.0  # past an episode's wall clock, how long its process has to report before it is killed
START_TIMEOUT_S = 120.0  # a fresh agent process importing openai and the agent; an episode's clock starts after


class AgentRunner:
    """Runs batches of agent episodes against one engine (see the module docstring)."""

    _run_ids = itertools.count()

    def __init__(self, engine: RolloutEngine, cfg: Any, tokenizer: Any, sampling: SamplingSettings,
                 eos_token_ids: list[int] | None = None):
        """cfg: an `AgentConfig`; tokenizer: the model's HF tokenizer; sampling: the job's (temperature, top_p)."""
        self.engine, self.cfg, self.sampling = engine, cfg, sampling
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids or [tokenizer.eos_token_id])
        self.renderer = ChatRenderer(tokenizer, resolve_chat_template(cfg.chat_template))
        self.parser_cls = load_tool_parser(cfg.tool_parser, tokenizer)
        self.endpoint = AgentEndpoint(self.renderer, self.parser_cls, self.eos_token_ids, engine.max_model_len,
                                      sampling.temperature, sampling.top_p)
        self.procs: AgentProcs | None = None
        self.metrics: dict[str, float] = {}

    @classmethod
    def from_config(cls, engine: RolloutEngine, cfg: Any, tokenizer: Any, sampling: SamplingSettings):
        return cls(engine, cfg, tokenizer, sampling)

    def close(self) -> None:
        """Stop the endpoint and the agent processes."""
        if self.procs is not None:
            self.procs.close()
            self.procs = None
        self.endpoint.stop()

    def run(self, prompts: list[Prompt], n: int, *, version: int = 0, seed: int | None = None,
            stop_event: threading.Event | None = None) -> list[Sample]:
        """n episodes per prompt; their samples grouped by prompt (episode 0's first). seed: each call's seed is
        `mix_seed(seed, crc32(uid), episode index, call index)`, as multi-turn episodes seed their turns."""
        start = time.perf_counter()
        if self.endpoint.url is None:
            self.endpoint.start()
        if self.procs is None:
            self.procs = AgentProcs(self.cfg.fn, dict(self.cfg.kwargs), self.cfg.num_procs, self.endpoint.requests)
        self.procs.replace_dead()
        killed_before, refused_before = self.procs.killed, self.endpoint.refused
        run_id = next(self._run_ids)
        episodes: list[tuple[Prompt, int, AgentEpisode, int]] = []  # prompt, index, episode, its child's serial
        outcome: dict[str, tuple[float, dict]] = {}
        for k, (p, j) in enumerate((p, j) for p in prompts for j in range(n)):
            ep = AgentEpisode(f"r{run_id}-{k}", EpisodeTranscript(self.renderer, self.eos_token_ids),
                              None if seed is None else (seed, zlib.crc32(p.uid.encode()), j),
                              self.cfg.max_turns, self.cfg.max_total_tokens)
            child = self.procs.serial(k % len(self.procs.children))
            episodes.append((p, j, ep, child))
            self.endpoint.episodes[ep.id] = ep
        deadline = {}
        try:
            for k, (p, j, ep, _) in enumerate(episodes):
                task = {"uid": p.uid, "index": j, "prompt": p.text if p.text is not None else
                        self.renderer.decode(p.prompt_ids), "reference": p.reference, "meta": dict(p.meta),
                        "model": SERVED_MODEL}
                deadline[ep.id] = time.monotonic() + START_TIMEOUT_S + self.cfg.episode_timeout_s
                self.procs.start_episode(k % len(self.procs.children), ep.id, self.endpoint.episode_url(ep), ep.key,
                                         task, self.cfg.episode_timeout_s)
            self._loop(episodes, outcome, deadline, version, stop_event)
        finally:
            for _, _, ep, _ in episodes:
                self.endpoint.episodes.pop(ep.id, None)
            self._drain(version)
        samples = self._samples(prompts, n, episodes, outcome)
        self.metrics = self._metrics(samples, episodes, time.perf_counter() - start, killed_before, refused_before)
        return samples

    # ---- the event loop ------------------------------------------------------------------------------------
    def _loop(self, episodes, outcome, deadline, version, stop_event) -> None:
        """Until every episode's agent reported (returned, raised, timed out, or lost its process): a limit ends an
        episode's recording at once, and the agent may still return its reward."""
        by_id = {ep.id: (ep, child) for _, _, ep, child in episodes}
        pending = set(by_id)
        events = self.endpoint.requests
        while pending:
            if stop_event is not None and stop_event.is_set():
                for ep, _ in by_id.values():
                    ep.end(FINISH_INTERRUPTED, "interrupted mid-episode by a pause (agent episodes are not resumed "
                                               "yet)")
                break
            try:
                first = events.get(timeout=0.05)
            except queue.Empty:
                self._check_deadlines(by_id, deadline, pending)
                continue
            batch = []
            for event in self._gather(first):
                if event[0] == "generate":
                    batch.append(event[1])
                elif event[0] == "agent_started":
                    if event[1] in deadline:
                        deadline[event[1]] = time.monotonic() + self.cfg.episode_timeout_s
                else:
                    self._on_agent_event(event, by_id, outcome, pending)
            if batch:
                self._generate(batch, version, stop_event)
            self._check_deadlines(by_id, deadline, pending)

    def _drain(self, version: int) -> None:
        """Answer calls still queued when the batch ended (a pause) as aborted; drop late agent reports."""
        while True:
            try:
                event = self.endpoint.requests.get_nowait()
            except queue.Empty:
                return
            if event[0] == "generate":
                event[1].future.set_result((Segment(finish_reason="abort"), version))

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

    def _generate(self, batch: list[GenerationRequest], version: int, stop_event) -> None:
        from vllm import SamplingParams

        for r in [r for r in batch if r.episode.finish is not None]:  # ended while queued: nothing to generate
            r.future.set_result((Segment(finish_reason="abort"), version))
            batch.remove(r)
        if not batch:
            return
        s = self.sampling
        requests = {f"{r.episode.id}-c{r.episode.transcript.calls}": r for r in batch}
        engine_requests = {rid: (r.context, SamplingParams(n=1, logprobs=0, max_tokens=r.max_tokens,
                                                          temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                                          seed=r.seed, stop_token_ids=r.stop_token_ids or None))
                           for rid, r in requests.items()}
        try:
            segments = self.engine.run(engine_requests, None, stop_event)
        except BaseException as e:
            for r in batch:
                r.future.set_exception(e)
            raise
        for rid, r in requests.items():
            r.future.set_result((segments[rid], version))

    def _on_agent_event(self, event: tuple, by_id: dict, outcome: dict, pending: set) -> None:
        kind = event[0]
        if kind == "agent_proc_dead":
            serial, why = event[1], event[2]
            for ep, child in by_id.values():
                if child == serial and ep.id in pending:
                    ep.end(FINISH_AGENT_ERROR, why)
                    pending.discard(ep.id)
            return
        entry = by_id.get(event[1])
        if entry is None or event[1] not in pending:  # an episode of an earlier batch, reporting late
            return
        pending.discard(event[1])
        ep = entry[0]
        if kind == "agent_error":
            ep.end(FINISH_AGENT_ERROR, event[2])
            return
        try:
            outcome[ep.id] = agent_outcome(event[2])
        except ValueError as e:
            ep.end(FINISH_AGENT_ERROR, str(e))
            return
        ep.end(FINISH_STOP)

    def _check_deadlines(self, by_id: dict, deadline: dict, pending: set) -> None:
        """An episode past its wall clock and the grace has blocked its process: kill it (its episodes end)."""
        now = time.monotonic()
        for ep, child in by_id.values():
            if ep.id in pending and now > deadline[ep.id] + BLOCKED_GRACE_S:
                pending.discard(ep.id)
                why = (f"agent blocked its process past the episode's {self.cfg.episode_timeout_s:g}s wall clock "
                       f"(episode {ep.id}); the process was killed")
                ep.end(FINISH_AGENT_ERROR, f"agent timed out after {self.cfg.episode_timeout_s:g}s (blocked its "
                                           "process, which was killed)")
                self.procs.kill(child, why)

    # ---- samples and metrics -------------------------------------------------------------------------------
    def _samples(self, prompts, n, episodes, outcome) -> list[Sample]:
        groups: list[list[Sample]] = [[] for _ in prompts]  # by position: a batch may repeat a prompt
        for k, (p, j, ep, _) in enumerate(episodes):
            group = groups[k // n]
            reward, extras = outcome.get(ep.id, (None, {}))
            failed = ep.failed
            if ep.failed is None and reward is None:
                failed = f"the episode ended ({ep.finish}) without the agent's reward"
            r = ep.transcript.samples[-1] if ep.transcript.samples else SampleRecord(list(p.prompt_ids))
            # the part after the last history split is the episode's sample (a group holds n, one per episode);
            # the parts before it are left out of training and counted (rollout/agent_split_tokens)
            info = {**extras, "turns": float(r.turns), "env_tokens": float(len(r.ids) - sum(r.mask)),
                    "agent_history_splits": float(ep.transcript.splits),  # summed by the pool: the step's splits
                    "agent_error": float(ep.finish == FINISH_AGENT_ERROR)}
            token_rewards = None
            if failed is None:  # the reward on the last model token (sequence and reward-to-go paths both see it)
                token_rewards = [0.0] * len(r.ids)
                if r.ids:
                    last_model = max((t for t, m in enumerate(r.mask) if m), default=len(r.ids) - 1)
                    token_rewards[last_model] = reward
            group.append(Sample(prompt_uid=p.uid, sample_index=j, prompt_ids=list(r.prompt_ids),
                                completion_ids=list(r.ids), logprobs=list(r.logprobs), loss_mask=list(r.mask),
                                versions=list(r.versions), finish_reason=ep.finish or FINISH_LENGTH,
                                reward=None if failed else reward, token_rewards=token_rewards, failed=failed,
                                reward_info=info, worker_id=self.engine.worker_id, turn_starts=list(r.turn_starts)))
        return [s for group in groups for s in group]

    def _metrics(self, samples, episodes, seconds, killed_before, refused_before) -> dict[str, float]:
        model = sum(sum(s.loss_mask) for s in samples)
        eps = [ep for _, _, ep, _ in episodes]
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
                "rollout/truncated": float(sum(ep.finish == FINISH_LENGTH for ep in eps))}
