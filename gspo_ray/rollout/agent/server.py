"""The OpenAI-compatible endpoint a rollout worker serves to its agents: a FastAPI app in the worker's process.

    endpoint = AgentEndpoint(renderer, parser_cls, tokenizer, eos_ids, max_model_len, temperature, top_p)
    endpoint.start()                                     # uvicorn on 127.0.0.1, a free port, in a thread
    endpoint.add(episode)                                # POST {endpoint.url}/ep/{episode.id}/v1/chat/completions
    req = endpoint.requests.get()                        # GenerationRequest: ids + SamplingParams, to the engine
    req.future.set_result((segment, version))            # the handler answers the agent

One URL per episode (`/ep/<episode id>/v1`), the episode's own random key as the API key: a call with another
episode's id, or to an episode that ended, is refused, so concurrent episodes never mix. The handler checks the
request (`requests.check_chat_request`), plans the engine context token-exactly (`transcript`), and queues one
generation; whoever owns the engine (`runner.AgentRunner`) gathers queued generations into one engine batch. A
refused request ends its episode (finish_reason "agent_error", the refusal as the reason), except a limit
(max_turns, max_total_tokens, the engine's max_model_len), which ends it with finish_reason "length".
"""
from __future__ import annotations

import asyncio
import queue
import secrets
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request  # at module level: the handlers' annotations are resolved in these globals
from fastapi.responses import JSONResponse

from gspo_ray.rollout.agent.requests import (SERVED_MODEL, RequestError, check_chat_request,
                                             check_completion_request)
from gspo_ray.rollout.agent.replay import ReplayRecord
from gspo_ray.rollout.agent.tool_calls import reply_message
from gspo_ray.rollout.agent.transcript import ChatRenderer, EpisodeTranscript
from gspo_ray.rollout.engine import Segment

FINISH_STOP, FINISH_LENGTH, FINISH_AGENT_ERROR, FINISH_INTERRUPTED = "stop", "length", "agent_error", "interrupted"


@dataclass
class AgentEpisode:
    """One episode as the endpoint sees it: its id and key, limits, its recording, how it ended."""

    id: str
    transcript: EpisodeTranscript
    seed_parts: tuple[int, ...] | None  # per-call seed = mix_seed(*seed_parts, call index); None: unseeded
    max_turns: int
    max_total_tokens: int
    key: str = field(default_factory=lambda: secrets.token_hex(16))
    busy: bool = False
    finish: str | None = None
    failed: str | None = None
    replay: ReplayRecord | None = None  # a resumed episode's record, answered from until the agent diverges
    replayed_calls: int = 0  # calls answered (wholly or in part) from `replay`
    replay_diverged: bool = False  # a call did not match the record: the rest was sampled anew

    def end(self, finish: str, failed: str | None = None) -> None:
        if self.finish is None:
            self.finish, self.failed = finish, failed


@dataclass
class GenerationRequest:
    """One model call for the engine: the context ids and the call's limits; answered through `future` with
    (Segment of the whole reply, one policy version per reply token, the rendered ids' version). A call cut by a
    partial-rollout budget keeps what it produced in `done_*` and is continued from there in a later round."""

    episode: AgentEpisode
    context: list[int]
    max_tokens: int
    stop_token_ids: list[int]
    seed: int | None
    new_sample: bool = False  # the call starts a new sample (`context` is its prompt)
    rendered: list[int] = field(default_factory=list)  # the ids this call appends before the reply (mask 0)
    done_ids: list[int] = field(default_factory=list)
    done_logprobs: list[float] = field(default_factory=list)
    done_versions: list[int] = field(default_factory=list)
    rendered_version: int | None = None  # stamped when the call is first seen by the runner (or from a record)
    future: Future = field(default_factory=Future)


class AgentEndpoint:
    """The FastAPI app and its uvicorn thread; episodes are added and removed by the runner."""

    def __init__(self, renderer: ChatRenderer, parser_cls: Any, eos_token_ids: frozenset[int], max_model_len: int,
                 temperature: float, top_p: float):
        self.renderer, self.parser_cls = renderer, parser_cls
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.temperature, self.top_p = temperature, top_p
        self.episodes: dict[str, AgentEpisode] = {}
        self.requests: queue.Queue = queue.Queue()  # GenerationRequests, and the runner's other events
        self.refused = 0  # requests answered with an error, all time
        self._server, self._thread, self.url = None, None, None

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> str:
        """Serve on 127.0.0.1 (the agents run on this node), a free port; returns the base URL."""
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(self.build_app(), log_level="warning", lifespan="off", access_log=False,
                                timeout_graceful_shutdown=1)  # an agent's open connection never holds up a stop
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="agent-endpoint")
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agent endpoint did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None

    def episode_url(self, episode: AgentEpisode) -> str:
        return f"{self.url}/ep/{episode.id}/v1"

    # ---- the app -------------------------------------------------------------------------------------------
    def build_app(self) -> FastAPI:
        app = FastAPI(title="gspo-ray agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        @app.post("/ep/{episode_id}/v1/chat/completions")
        async def chat_completions(episode_id: str, request: Request):
            return await self._serve(episode_id, request, self._chat)

        @app.post("/ep/{episode_id}/v1/completions")
        async def completions(episode_id: str, request: Request):
            return await self._serve(episode_id, request, self._text)

        @app.get("/ep/{episode_id}/v1/models")
        async def models(episode_id: str, request: Request):
            try:
                self._own_episode(episode_id, request.headers.get("authorization", ""))
            except RequestError as e:
                return JSONResponse(e.body(), status_code=e.status)
            return {"object": "list", "data": [{"id": SERVED_MODEL, "object": "model", "owned_by": "gspo-ray"}]}

        return app

    async def _serve(self, episode_id: str, request: Request, handle) -> JSONResponse:
        """Answer one call of an episode; a refused or failed call ends the episode (a limit reached ended it
        first, with finish_reason "length"), a call with another episode's id or key leaves that episode alone."""
        try:
            episode = self._own_episode(episode_id, request.headers.get("authorization", ""))
        except RequestError as e:
            self.refused += 1
            return JSONResponse(e.body(), status_code=e.status)
        try:
            try:
                body = await request.json()
            except ValueError:
                raise RequestError("the request body is not JSON") from None
            return JSONResponse(await handle(episode, body))
        except RequestError as e:
            self.refused += 1
            episode.end(FINISH_AGENT_ERROR, f"refused request: {e.param or 'request'}: {e.message}")
            return JSONResponse(e.body(), status_code=e.status)
        except Exception as e:  # the endpoint's own failure on this call (a template, a tool parser): its episode
            episode.end(FINISH_AGENT_ERROR, f"the endpoint failed on this call: {type(e).__name__}: {e}")
            return JSONResponse(RequestError(f"{type(e).__name__}: {e}", None, 500, "internal_error",
                                             "server_error").body(), status_code=500)

    def _own_episode(self, episode_id: str, authorization: str) -> AgentEpisode:
        episode = self.episodes.get(episode_id)
        if episode is None:
            raise RequestError(f"episode {episode_id!r} is not running here", "episode", 404, "episode_not_found")
        if not secrets.compare_digest(authorization.removeprefix("Bearer ").strip(), episode.key):
            raise RequestError(f"episode {episode_id!r} is not this client's episode (its URL and API key belong "
                               "to different episodes)", "episode", 403, "wrong_episode", "permission_error")
        if episode.finish is not None:
            raise RequestError(f"episode {episode_id!r} has ended ({episode.finish}"
                               f"{': ' + episode.failed if episode.failed else ''})", "episode", code="episode_ended")
        if episode.busy:
            raise RequestError(f"episode {episode_id!r} already has a call in flight; an episode's calls run one at "
                               "a time", "episode", code="call_in_flight")
        return episode

    async def _chat(self, episode: AgentEpisode, body: Any) -> dict:
        def checked():
            call = check_chat_request(body, SERVED_MODEL, temperature=self.temperature, top_p=self.top_p)
            try:
                plan = episode.transcript.plan(call.messages, call.tools)
            except Exception as e:  # the template could not render these messages
                raise RequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                                   "messages") from None
            return call, plan, call.max_tokens, call.stop

        call, plan, ids, logprobs, stopped, text, versions, rendered_version = await self._call(episode, checked)
        message = reply_message(self.parser_cls, self.renderer.tokenizer, text, stopped, call)
        episode.transcript.commit(plan, ids, logprobs, versions, message, rendered_version)
        finish = "tool_calls" if message.get("tool_calls") else ("stop" if stopped else "length")
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": SERVED_MODEL, "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                                    "logprobs": None}], "usage": _usage(plan.context, ids)}

    async def _text(self, episode: AgentEpisode, body: Any) -> dict:
        def checked():
            prompt, max_tokens, stop = check_completion_request(body, SERVED_MODEL, temperature=self.temperature,
                                                                top_p=self.top_p)
            return prompt, episode.transcript.plan_text(prompt), max_tokens, stop

        _, plan, ids, logprobs, stopped, text, versions, rendered_version = await self._call(episode, checked)
        episode.transcript.commit(plan, ids, logprobs, versions, {"text": text}, rendered_version)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": SERVED_MODEL, "choices": [{"index": 0, "text": text, "finish_reason":
                                                    "stop" if stopped else "length", "logprobs": None}],
                "usage": _usage(plan.context, ids)}

    async def _call(self, episode: AgentEpisode, checked) -> tuple:
        """Check and plan a call (`checked()` -> (request, plan, max_tokens, stop strings)), apply the episode's
        limits, answer it from a resumed episode's record (`replay`) or queue it for the engine, wait: (request,
        plan, ids, log-probs, stopped, text up to the stop, policy version per token, rendered ids' version)."""
        rec = episode.transcript
        try:
            if rec.calls >= episode.max_turns:
                raise _Limit(f"the episode's max_turns ({episode.max_turns}) calls are used", "max_turns")
            call, plan, max_tokens, stop = checked()
            stop_ids = self._stop_ids(stop)
            budget = episode.max_total_tokens - rec.completion_tokens - (0 if plan.new_sample else len(plan.rendered))
            cap = min(budget, self.max_model_len - len(plan.context))
            if cap <= 0:
                raise _Limit(f"no room left for a reply: the context is {len(plan.context)} of max_model_len "
                             f"{self.max_model_len} tokens, {max(budget, 0)} of the episode's max_total_tokens left",
                             "messages", code="context_length_exceeded")
        except _Limit as e:
            episode.end(FINISH_LENGTH)
            raise e.error from None
        seed = None
        if episode.seed_parts is not None:
            from gspo_ray.rollout.engine import mix_seed

            seed = mix_seed(*episode.seed_parts, rec.calls)
        req = GenerationRequest(episode, plan.context, min(max_tokens or cap, cap), stop_ids, seed,
                                new_sample=plan.new_sample, rendered=list(plan.rendered))
        hit = self._replayed(episode, plan.context)
        if hit is not None and hit.complete:  # answered from the record: no engine work
            finish = "stop" if hit.ids and hit.ids[-1] in self.eos_token_ids | set(stop_ids) else "length"
            seg, versions, rendered_version = (Segment(list(hit.ids), list(hit.logprobs), finish),
                                               list(hit.versions), hit.rendered_version)
        else:
            if hit is not None:  # the record ends inside this reply: the engine continues it
                req.done_ids, req.done_logprobs = list(hit.ids), list(hit.logprobs)
                req.done_versions, req.rendered_version = list(hit.versions), hit.rendered_version
            episode.busy = True
            try:
                self.requests.put(("generate", req))
                seg, versions, rendered_version = await asyncio.wrap_future(req.future)
            finally:
                episode.busy = False
        if episode.finish is not None:  # ended while generating (its wall clock): the reply is not recorded
            raise RequestError(f"the episode ended ({episode.finish})", "episode", code="episode_ended")
        if seg.finish_reason == "abort":
            episode.end(FINISH_INTERRUPTED, "interrupted mid-episode by a pause (outside partial rollouts, agent "
                                            "episodes are not continued)")
            raise RequestError("the rollout worker paused; the episode ends", None, 503, "paused", "server_error")
        ids = list(seg.token_ids)
        cut = next((i for i, t in enumerate(ids) if t in self.eos_token_ids), None)
        stopped = cut is not None or (seg.finish_reason == "stop" and bool(stop_ids))
        text = self.renderer.decode(ids if cut is None else ids[:cut])
        return call, plan, ids, list(seg.logprobs), stopped, text, versions, rendered_version

    @staticmethod
    def _replayed(episode: AgentEpisode, context: list[int]):
        """The record's answer to a resumed episode's call (`replay.ReplayHit`), or None; the first call that does
        not match, and any call after the record's end, is sampled anew."""
        if episode.replay is None:
            return None
        hit = episode.replay.match(context)
        if hit is None:
            episode.replay, episode.replay_diverged = None, True
            return None
        episode.replayed_calls += 1
        if not hit.complete:  # the record's last reply: nothing recorded after it
            episode.replay = None
        return hit

    def _stop_ids(self, stop: list[str]) -> list[int]:
        """Each stop string as the one token it must be (the engine stops on ids; it runs without a tokenizer)."""
        ids = []
        for s in stop:
            enc = self.renderer.encode(s)
            if len(enc) != 1:
                raise RequestError(f"stop {s!r} is {len(enc)} tokens; only single-token stop strings are served",
                                   "stop")
            ids.append(enc[0])
        return ids


def _usage(context: list[int], ids: list[int]) -> dict:
    return {"prompt_tokens": len(context), "completion_tokens": len(ids), "total_tokens": len(context) + len(ids)}


class _Limit(Exception):
    """An episode limit reached: the call is refused and the episode ends with finish_reason "length"."""

    def __init__(self, message: str, param: str, code: str = "episode_limit"):
        super().__init__(message)
        self.error = RequestError(message, param, code=code)
