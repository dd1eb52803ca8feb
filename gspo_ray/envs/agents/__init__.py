"""Tasks written as agents against the OpenAI API (`rollout.agent`), beside their native environments.

- `calculator_agent.solve`: the calculator task (gspo_ray/envs/calculator.py) with a tool; imports only `openai`.
- `calculator_protocol`: the chat template and tool parser that make the tiny model's chat the calculator's token
  protocol, so an agent episode is token for token the native environment's episode.
"""
