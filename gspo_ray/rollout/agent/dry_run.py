"""One episode of an agent against a stand-in endpoint: the preflight's dry call (no engine, no server).

    reward, calls = dry_episode(fn, prompt, kwargs, temperature=1.0, top_p=1.0, max_turns=8, timeout_s=60)

The agent gets a real `openai.AsyncOpenAI` whose transport (httpx.MockTransport) answers in this process: each
request goes through the endpoint's own checks (`requests.check_chat_request`), and every reply is the prompt's
reference as the model's text, finish_reason "stop". What fails raises with the reason: a refused request (naming
the parameter), the agent's own exception, a timeout, or a return value without a reward.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable

from gspo_ray.data.records import Prompt
from gspo_ray.rollout.agent.requests import SERVED_MODEL, RequestError, check_chat_request
from gspo_ray.rollout.agent.protocol import agent_outcome


def dry_episode(fn: Callable, prompt: Prompt, kwargs: dict[str, Any], temperature: float, top_p: float,
                max_turns: int, timeout_s: float) -> tuple[float, int]:
    """(reward, calls made) of one episode on `prompt`; ValueError naming what went wrong."""
    import httpx
    import openai

    calls, refused = [0], []

    def answer(request: httpx.Request) -> httpx.Response:
        try:
            if not request.url.path.endswith("/chat/completions"):
                raise RequestError(f"{request.url.path} is not served (chat completions only)", None, 404)
            check_chat_request(json.loads(request.content or b"null"), SERVED_MODEL, temperature=temperature,
                               top_p=top_p)
            if calls[0] >= max_turns:
                raise RequestError(f"the episode's max_turns ({max_turns}) calls are used", "max_turns")
        except RequestError as e:
            refused.append(e)
            return httpx.Response(e.status, json=e.body())
        calls[0] += 1
        message = {"role": "assistant", "content": "" if prompt.reference is None else str(prompt.reference)}
        return httpx.Response(200, json={
            "id": "chatcmpl-dry", "object": "chat.completion", "created": int(time.time()), "model": SERVED_MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}})

    async def episode() -> Any:
        http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        client = openai.AsyncOpenAI(base_url="http://agent-endpoint/ep/dry/v1", api_key="dry", max_retries=0,
                                    http_client=http)
        try:
            task = {"uid": prompt.uid, "index": 0, "prompt": prompt.text, "reference": prompt.reference,
                    "meta": dict(prompt.meta), "model": SERVED_MODEL}
            return await asyncio.wait_for(fn(client, task, **kwargs), timeout_s)
        finally:
            await client.close()

    try:
        value = asyncio.run(episode())
    except asyncio.TimeoutError:
        raise ValueError(f"the agent did not return within {timeout_s:g} s (rollout.agent.episode_timeout_s)") from None
    except Exception as e:
        if refused:  # the agent raised on a refusal: the refusal is the reason
            e = refused[0]
            raise ValueError(f"the endpoint refused a request: {e.param or 'request'}: {e.message}") from None
        raise ValueError(f"the agent raised {type(e).__name__}: {e}") from None
    if refused:
        raise ValueError(f"the endpoint refused a request: {refused[0].param or 'request'}: {refused[0].message}")
    reward, _ = agent_outcome(value)
    return reward, calls[0]
