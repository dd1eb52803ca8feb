"""Agent episodes: a user's agent, written against the OpenAI API, run unchanged and recorded token for token.

- `requests`: what a chat-completions call may ask (the job's sampling only) and the OpenAI-style errors;
- `transcript`: the token-exact record of an episode (reuse the engine's ids; a rewritten history splits);
- `tool_calls`: reply text -> tool calls, through vLLM's tool parsers;
- `server`: the FastAPI endpoint in the rollout worker's process, one URL per episode;
- `agent_procs`: the killable child processes the agents run in, many episodes at once each (asyncio);
- `replay`: a resumed episode's recorded turns, answered from the record until the agent diverges;
- `runner`: `AgentRunner`, which drives the engine for a batch of episodes (or, under partial rollouts, one round
  of episodes kept alive between rounds) and returns `Sample`s.
docs/multi-turn-and-partial.md describes the protocol.
"""
