"""Sparse upcycling: a dense Llama HF directory -> a Mixtral (Llama + MoE) HF directory whose experts start as the
dense MLP.

    gspo-ray models upcycle --src runs/models/smollm2-135m-instruct --out runs/models/smollm2-moe-4x2 \\
        --experts 4 --top-k 2 --noise 0.01 --seed 0

Every layer's MLP becomes `E` experts, each a copy of the dense gate/up/down projections plus Gaussian noise of
`noise` x that tensor's std (so experts differ and the router has something to choose between), and a router
`[E, hidden]` drawn from N(0, router_std^2) (small: near-uniform routing at the start). Mixtral renormalises the
top-k probabilities, so with noise 0 the layer computes `sum_k p_k * MLP(x) = MLP(x)`: exactly the dense model,
whatever the router says. Attention, norms and embeddings are copied unchanged (tied embeddings stay tied).

Why Mixtral: it is `LlamaForCausalLM` with the MLP swapped for a top-k MoE block, and transformers, vLLM and the
trainer's converter (`gspo_ray.trainer.weights.bridge`) all load it. top_k must be >= 2: with one expert per token the
renormalised weight is always 1 and the router would get no gradient.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

_MLP = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight")
_EXPERT_NAME = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # Mixtral's names for the projections
# Llama config keys Mixtral does not have (it would refuse them or silently ignore them)
_LLAMA_ONLY = ("attention_bias", "mlp_bias", "pretraining_tp", "_model_name_or_path", "transformers_version")
# Non-weight files of the source that describe the source itself, not the upcycled model
_SKIP_FILES = ("gguf_import.json",)


@dataclass
class UpcycleReport:
    """What `upcycle` wrote."""

    out: str
    experts: int
    top_k: int
    noise: float
    params: int
    active_params: int  # per token: everything but the (E - k) experts a token does not use


def mixtral_config(dense: dict, experts: int, top_k: int) -> dict:
    """Dense Llama config.json -> the Mixtral config.json of its upcycled MoE."""
    if dense.get("model_type") != "llama":
        raise ValueError(f"config.json model_type {dense.get('model_type')!r}: upcycling needs a 'llama' model")
    if not 2 <= top_k <= experts:
        raise ValueError(f"--top-k {top_k}: must be in [2, experts={experts}] (top-1 renormalised to weight 1 "
                         "leaves the router without a gradient)")
    if dense.get("mlp_bias") or dense.get("attention_bias"):
        raise ValueError("config.json: mlp_bias/attention_bias are not supported by Mixtral")
    cfg = {k: v for k, v in dense.items() if k not in _LLAMA_ONLY}
    cfg |= {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": experts,
            "num_experts_per_tok": top_k, "sliding_window": None, "output_router_logits": False,
            "router_aux_loss_coef": 0.0, "router_jitter_noise": 0.0}
    return cfg


def upcycle_state(dense: dict[str, torch.Tensor], experts: int, noise: float = 0.0, router_std: float = 0.02,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """Dense HF state dict (Llama names) -> Mixtral state dict. Expert e of layer i: each projection W becomes
    `W + noise * std(W) * N(0, 1)` (expert noise drawn per expert, per tensor); router ~ N(0, router_std^2)."""
    g = torch.Generator().manual_seed(seed)
    out, layers = {}, set()
    for name, w in dense.items():
        m = _MLP.fullmatch(name)
        if m is None:
            out[name] = w
            continue
        layer, proj = m.group(1), m.group(2)
        layers.add(int(layer))
        scale = noise * float(w.float().std())
        for e in range(experts):
            copy = w.clone()
            if scale > 0:
                copy += (scale * torch.randn(w.shape, generator=g)).to(w.dtype)
            out[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{_EXPERT_NAME[proj]}.weight"] = copy
    for layer in sorted(layers):
        hidden = dense[f"model.layers.{layer}.mlp.gate_proj.weight"].shape[1]
        dtype = dense[f"model.layers.{layer}.mlp.gate_proj.weight"].dtype
        out[f"model.layers.{layer}.block_sparse_moe.gate.weight"] = (
            router_std * torch.randn(experts, hidden, generator=g)).to(dtype)
    return out


def upcycle(src: str | Path, out: str | Path, experts: int, top_k: int, noise: float = 0.0,
            router_std: float = 0.02, seed: int = 0) -> UpcycleReport:
    """Write the upcycled Mixtral directory (safetensors, config, tokenizer files of `src`) to `out`."""
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    src, out = Path(src), Path(out)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"--src {src}: no config.json (expected a HF model directory)")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"--src {src}: no *.safetensors files")
    if noise < 0 or router_std < 0:
        raise ValueError("--noise and --router-std must be >= 0")
    dense_cfg = json.loads((src / "config.json").read_text())
    cfg = mixtral_config(dense_cfg, experts, top_k)
    dense = {k: v for f in files for k, v in load_file(str(f)).items()}
    state = upcycle_state(dense, experts, noise=noise, router_std=router_std, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in (*_SKIP_FILES, "config.json") \
                and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_torch_state_dict(state, out)
    total = sum(t.numel() for t in state.values())
    expert_params = sum(t.numel() for k, t in state.items() if ".experts." in k)
    report = UpcycleReport(str(out), experts, top_k, noise, total, total - expert_params * (experts - top_k) // experts)
    (out / "upcycle.json").write_text(json.dumps(asdict(report) | {"src": str(src), "seed": seed,
                                                                   "router_std": router_std}, indent=2) + "\n")
    return report


def mean_logprobs(model_dir: str | Path, texts: list[str]) -> list[float]:
    """Teacher-forced mean log-prob per token of each text under the model in `model_dir` (transformers, fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tok(text)["input_ids"]])
            logsm = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            out.append(float(logsm.gather(-1, ids[0, 1:, None]).mean()))
    return out


# Fixed texts for the before/after comparison: a chat turn in SmolLM2's template and two plain sentences.
CHECK_TEXTS = ("<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n12 + 7 = 19.<|im_end|>\n",
               "The capital of France is Paris. It is known for the Eiffel Tower and its museums.",
               "def add(a, b):\n    return a + b\n")
