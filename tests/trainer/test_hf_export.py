"""HF export of trainer checkpoints (gspo_ray/trainer/weights/hf_export.py), offline and from any layout.

One 2-rank scenario trains three tiny models in three layouts and saves checkpoints: Qwen3-MoE with EP=2 (dense
params DP=2), Llama with tied embeddings and a chat template at DP=2, Qwen2 with an odd vocabulary at TP=2 (+SP).
The MoE run is also resumed from its first checkpoint on fresh ranks. Here, in the test process (no process
group), each checkpoint is converted to a HF directory that transformers loads; its log-probs must be the trainer's.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from _spawn import algo_cfg, make_batch, run_ranks, trainer_cfg
from gspo_ray.trainer.weights.hf_export import export_checkpoint

CHAT_TEMPLATE = "{% for m in messages %}<bos>{{ m['content'] }}={% endfor %}"


def hf_logprobs(hf_dir, batch) -> torch.Tensor:
    """transformers' log p(tokens[b, t] | tokens[b, :t]), 0 at t = 0 and past each length (the trainer's layout)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    with torch.no_grad():
        logsm = torch.log_softmax(model(batch.tokens).logits.float(), dim=-1)[:, :-1]
    logp = torch.zeros(batch.tokens.shape)
    logp[:, 1:] = logsm.gather(-1, batch.tokens[:, 1:, None])[..., 0]
    return logp * (torch.arange(logp.shape[1])[None] < batch.lengths[:, None])


def _train(rank, world, port, model_dir, tcfg, batches, probe, ckpts: list[str], load_from=None):
    """One trainer: optionally load a checkpoint, one step per batch, save after each step into ckpts[i]. Batches
    without old log-probs get the initial policy's (set once: a resumed run trains on exactly the same batch)."""
    from gspo_ray.trainer.worker import TrainerWorker

    w = TrainerWorker(rank, world, "127.0.0.1", port, model_dir, tcfg, algo_cfg())
    for b in batches:
        if not b.old_logp.any():
            b.old_logp = w.compute_logprobs(b)
    if load_from is not None:
        w.load(load_from)
    for batch, ckpt_dir in zip(batches, ckpts):
        w.train_step(batch)
        w.save(ckpt_dir)
    logp = w.compute_logprobs(probe)
    w.shutdown()
    return logp


def _scenario(rank, world, ports, models, root, batches, probe):
    b1, b2 = batches
    moe = trainer_cfg(2, ep=2, micro_batch_size=2)
    out = {"ep2": _train(rank, world, ports[0], models["qwen3_moe"], moe, [b1, b2], probe,
                         [f"{root}/ep2/step1", f"{root}/ep2/step2"])}
    _train(rank, world, ports[1], models["qwen3_moe"], moe, [b2], probe, [f"{root}/ep2/resumed2"],
           load_from=f"{root}/ep2/step1")
    for layout, arch, port, tp in (("dp2", "llama", ports[2], 1), ("tp2", "qwen2", ports[3], 2)):
        out[layout] = _train(rank, world, port, models[arch], trainer_cfg(2, tp=tp), [make_batch(8, seed=11)],
                             probe, [f"{root}/{layout}"])
    return out


@pytest.fixture(scope="module")
def trained(tiny_moe_dir, tiny_qwen2_dir, tiny_llama_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("hf_export")
    models = {"qwen3_moe": str(tiny_moe_dir), "qwen2": str(tiny_qwen2_dir), "llama": str(tiny_llama_dir)}
    # the Llama source gets a chat template, which the export must carry
    llama = root / "llama_chat"
    shutil.copytree(models["llama"], llama)
    tok = AutoTokenizer.from_pretrained(str(llama))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(llama))
    models["llama"] = str(llama)
    probe = make_batch(8, seed=13)
    ranks = run_ranks(_scenario, 2, (models, str(root), [make_batch(8, seed=11), make_batch(8, seed=12)], probe),
                      n_ports=4)
    return {"root": root, "models": models, "probe": probe, "logp": ranks[0]}


@pytest.mark.parametrize("layout,arch", [("ep2/step2", "qwen3_moe"), ("dp2", "llama"), ("tp2", "qwen2")])
def test_export_loads_in_transformers_with_the_trainers_logprobs(trained, tmp_path, layout, arch):
    out = export_checkpoint(trained["root"] / layout, trained["models"][arch], tmp_path / "hf")
    probe = trained["probe"]
    logp = hf_logprobs(out, probe)
    trainer_logp = trained["logp"][layout.split("/")[0]]
    assert trainer_logp.abs().sum() > 0
    assert (logp - trainer_logp).abs().max() < 1e-5
    # the weights really moved: the original model's log-probs are further away than the tolerance
    base = hf_logprobs(trained["models"][arch], probe)
    assert (base - trainer_logp).abs().max() > 1e-3
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= {p.name for p in out.iterdir()}
    source = Path(trained["models"][arch]) / "generation_config.json"  # stop tokens as in training
    assert json.loads((out / "generation_config.json").read_text()) == json.loads(source.read_text())


def test_export_carries_tied_embeddings_chat_template_and_dtype(trained, tmp_path):
    from transformers import AutoTokenizer

    out = export_checkpoint(trained["root"] / "dp2", trained["models"]["llama"], tmp_path / "bf16", dtype="bfloat16")
    tensors = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in tensors  # tied: HF reuses the embedding
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.apply_chat_template([{"role": "user", "content": "12"}], tokenize=False) == "<bos>12="


def test_resumed_run_exports_the_same_weights(trained, tmp_path):
    moe = trained["models"]["qwen3_moe"]
    a = load_file(str(export_checkpoint(trained["root"] / "ep2/step2", moe, tmp_path / "a") / "model.safetensors"))
    b = load_file(str(export_checkpoint(trained["root"] / "ep2/resumed2", moe, tmp_path / "b") /
                      "model.safetensors"))
    one = load_file(str(export_checkpoint(trained["root"] / "ep2/step1", moe, tmp_path / "c") /
                        "model.safetensors"))
    assert set(a) == set(b) and len(a) > 0
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], one[k]) for k in a)  # step 2 changed something after step 1


def test_export_command(trained, tmp_path):
    from gspo_ray.cli import app

    runner, ckpt = CliRunner(), str(trained["root"] / "tp2")
    res = runner.invoke(app, ["export", ckpt, "--out", str(tmp_path / "m"), "--model-dir", trained["models"]["qwen2"]])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "m" / "model.safetensors").is_file()
    again = runner.invoke(app, ["export", ckpt, "--out", str(tmp_path / "m"), "--model-dir",
                                trained["models"]["qwen2"]])
    assert again.exit_code == 2 and "--overwrite" in again.output
    # a bare trainer checkpoint outside a run directory: the model it trained from must be named
    res = runner.invoke(app, ["export", ckpt, "--out", str(tmp_path / "n")])
    assert res.exit_code == 2 and "--model-dir" in res.output
    res = runner.invoke(app, ["export", str(tmp_path), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "not a run directory" in res.output
