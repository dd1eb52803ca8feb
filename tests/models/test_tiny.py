"""The tiny-model factory: deterministic, char-level, untied, loadable by transformers."""
import hashlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gspo_ray.models.tiny import DEFAULT_ALPHABET, ensure_tiny_model, make_tiny_model


def _digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_tiny_moe_is_deterministic_and_char_level(tmp_path):
    a = make_tiny_model("qwen3_moe", tmp_path / "a", seed=3)
    b = make_tiny_model("qwen3_moe", tmp_path / "b", seed=3)
    c = make_tiny_model("qwen3_moe", tmp_path / "c", seed=4)
    assert _digest(a) == _digest(b) != _digest(c)
    tok = AutoTokenizer.from_pretrained(a)
    ids = tok("copy:4821=").input_ids
    assert len(ids) == len("copy:4821=")                      # one token per character, no BOS added
    assert tok.decode(ids + [tok.eos_token_id]) == "copy:4821=<eos>"
    assert len(tok) == len(DEFAULT_ALPHABET) + 3               # + pad, eos, bos
    model = AutoModelForCausalLM.from_pretrained(a)
    assert model.config.num_experts == 4 and model.config.num_experts_per_tok == 2
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok)) and torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2"])
def test_reloaded_tokenizer_matches_the_vocabulary(tmp_path, arch):
    # AutoTokenizer picks the model type's class on reload (Qwen2Tokenizer for qwen2): no extra token may appear
    path = make_tiny_model(arch, tmp_path / arch, seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == AutoModelForCausalLM.from_pretrained(path).config.vocab_size == len(DEFAULT_ALPHABET) + 3
    assert tok.get_added_vocab() == {"<pad>": 0, "<eos>": 1, "<bos>": 2}


def test_ensure_reuses_identical_model(tmp_path):
    p = ensure_tiny_model("qwen2", tmp_path / "m", seed=1)
    mtime = (p / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model("qwen2", tmp_path / "m", seed=1) == p
    assert (p / "model.safetensors").stat().st_mtime_ns == mtime
    ensure_tiny_model("qwen2", tmp_path / "m", seed=2)           # different seed -> rebuilt
    assert (p / "model.safetensors").stat().st_mtime_ns != mtime
