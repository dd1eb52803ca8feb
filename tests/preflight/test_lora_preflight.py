"""Preflight of trainer.lora (gspo_ray/preflight/lora.py): every bad LoRA input is one line naming the field or path,
exit 2, before Ray starts; a good adapter directory passes. No model is built (the tiny model's config is used)."""
import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from gspo_ray.cli import app
from gspo_ray.config import load_config
from gspo_ray.config.lora import check_lora_kind, LoRAConfig
from gspo_ray.models.tiny import build_config
from gspo_ray.preflight.lora import check_lora
from gspo_ray.preflight.model import PreflightError
from gspo_ray.preflight.report import PreflightReport
from gspo_ray.trainer.lora.peft_io import expected_adapter_shapes, write_peft_dir
from gspo_ray.trainer.model_spec import spec_from_hf_config

RECIPE = Path(__file__).resolve().parents[2] / "gspo_ray" / "recipes" / "tiny_moe.yaml"


def _hf(arch="qwen2", hidden=64):
    return build_config(arch, vocab_size=32, hidden=hidden, layers=2, experts=4, top_k=2).to_dict()


def _adapter(tmp_path, hidden=64, rank=8, alpha=16.0, name="adapter", targets=("q_proj", "v_proj")):
    spec = spec_from_hf_config(_hf(hidden=hidden), "m")
    shapes = expected_adapter_shapes(spec, rank, list(targets))
    return write_peft_dir({k: torch.zeros(s) for k, s in shapes.items()}, tmp_path / name, rank=rank, alpha=alpha,
                          target_modules=list(targets))


def _cfg(tmp_path, **lora):
    overrides = ["model.tiny.arch=qwen2", f"logging.out_dir={tmp_path}",
                 "trainer.lora=" + yaml.safe_dump({"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]}
                                                  | lora, default_flow_style=True).strip()]
    return load_config(RECIPE, overrides)


def _check(cfg, hf=None):
    report = PreflightReport()
    check_lora(cfg, _hf() if hf is None else hf, report)
    return report


def test_a_matching_adapter_passes(tmp_path):
    report = _check(_cfg(tmp_path, init_from=str(_adapter(tmp_path))))
    assert any("rank 8 alpha 16 on 4 linears" in line and "adapter-only pushes" in line for line in report.lines())


@pytest.mark.parametrize("case, expected", [
    ("missing", "trainer.lora.init_from: {p}: no such directory"),
    ("not_adapter", "not a PEFT adapter directory (needs adapter_config.json and adapter_model.safetensors)"),
    ("other_base", "has shape (8, 128), this model needs (8, 64) (an adapter of another base model)"),
    ("other_rank", "adapter r=4 lora_alpha=16.0, trainer.lora has rank=8 alpha=16"),
    ("other_targets", "tensors this run's trainer.lora does not train"),
])
def test_bad_init_from_is_one_line(tmp_path, case, expected):
    path = {"missing": lambda: tmp_path / "nope", "not_adapter": lambda: tmp_path,
            "other_base": lambda: _adapter(tmp_path, hidden=128),
            "other_rank": lambda: _adapter(tmp_path, rank=4),
            "other_targets": lambda: _adapter(tmp_path, targets=("q_proj", "v_proj", "o_proj"))}[case]()
    with pytest.raises(PreflightError) as e:
        _check(_cfg(tmp_path, init_from=str(path)))
    assert expected.format(p=path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("key, value, expected", [
    ("use_rslora", True, "use_rslora=true: rsLoRA scales the update by alpha / sqrt(r)"),
    ("use_dora", True, "use_dora=true: DoRA adds a magnitude vector"),
    ("rank_pattern", {"q_proj": 4}, 'rank_pattern={"q_proj": 4}: per-module ranks'),
    ("alpha_pattern", {"q_proj": 4.0}, 'alpha_pattern={"q_proj": 4.0}: per-module alphas'),
])
def test_init_from_lora_variants_the_trainer_refuses_stop_the_preflight(tmp_path, key, value, expected):
    """R12: the trainer refuses these adapter kinds when it loads them (after Ray and both pools started); the
    preflight names the adapter_config.json field first."""
    path = _adapter(tmp_path)
    peft = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**peft, key: value}))
    with pytest.raises(PreflightError) as e:
        _check(_cfg(tmp_path, init_from=str(path)))
    assert str(e.value) == (f"trainer.lora.init_from: {path}: adapter_config.json sets {expected}"
                            + str(e.value).split(expected, 1)[1]) and "\n" not in str(e.value)
    assert str(e.value).endswith("(plain LoRA only)")


def test_dropout_is_refused_naming_the_field(tmp_path):
    """R10: the old log-probs have no dropout, the train forward would; the ratio moves by noise alone."""
    with pytest.raises(PreflightError, match=r"^trainer\.lora\.dropout \(0\.05\) > 0: .*\(GSPO's sequence band is "
                                             r"~3e-4 wide\); set it to 0$"):
        _check(_cfg(tmp_path, dropout=0.05))
    assert _check(_cfg(tmp_path, dropout=0.0))


def test_rank_and_serving_combinations(tmp_path):
    with pytest.raises(PreflightError, match=r"trainer.lora.rank \(100\) exceeds .* smaller side \(64\)"):
        _check(_cfg(tmp_path, rank=100))
    with pytest.raises(PreflightError, match=r"rollout.lora_rank \(8\) on an MoE model"):
        _check(load_config(RECIPE, [f"logging.out_dir={tmp_path}", "trainer.lora={rank: 8}", "rollout.lora_rank=8"]),
               hf=_hf("qwen3_moe"))
    with pytest.raises(PreflightError, match=r"rollout.lora_rank \(8\) with trainer.lora.serve merged"):
        _check(load_config(RECIPE, [f"logging.out_dir={tmp_path}", "trainer.lora={rank: 8, serve: merged}",
                                    "rollout.lora_rank=8"]))
    with pytest.raises(PreflightError, match=r"rollout.lora_rank \(8\) without trainer.lora"):
        _check(load_config(RECIPE, [f"logging.out_dir={tmp_path}", "rollout.lora_rank=8"]))
    # the rank need not divide TP (only the base's split dimension is split): rank 3 under tp 2 passes
    assert _check(_cfg(tmp_path, rank=3).model_copy(update={"trainer": _cfg(tmp_path, rank=3).trainer.model_copy(
        update={"tp": 2, "num_workers": 2})}))


def test_checkpoint_kinds_must_match():
    lora = LoRAConfig(rank=8)
    with pytest.raises(ValueError, match="ckpt: a LoRA checkpoint \\(rank 8\\), this run trains the full model"):
        check_lora_kind({"rank": 8, "alpha": 16.0, "target_modules": ["q_proj"]}, None, "ckpt")
    with pytest.raises(ValueError, match="ckpt: a full fine-tuning checkpoint, this run has trainer.lora"):
        check_lora_kind(None, lora, "ckpt")
    with pytest.raises(ValueError, match="written with trainer.lora"):
        check_lora_kind({"rank": 4, "alpha": 16.0, "target_modules": list(lora.target_modules)}, lora, "ckpt")
    check_lora_kind(None, None, "ckpt")


def test_cli_stops_in_one_line_with_exit_2(tmp_path):
    job = tmp_path / "job.yaml"
    raw = yaml.safe_load(RECIPE.read_text())
    raw["logging"] = {"out_dir": str(tmp_path / "runs")}
    raw["model"]["tiny"]["arch"] = "qwen2"
    raw["trainer"]["lora"] = {"rank": 8, "init_from": str(tmp_path)}
    job.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(app, ["config", "validate", str(job)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "trainer.lora.init_from" in lines[0] and "not a PEFT adapter directory" in lines[0]
    raw["trainer"]["lora"] = {"rank": 8, "dropout": 0.1}
    job.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(app, ["config", "validate", str(job)])
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [
        "error: trainer.lora.dropout (0.1) > 0: the old log-probs are computed without dropout and the train forward "
        "with it, so the importance ratio moves by dropout noise alone (GSPO's sequence band is ~3e-4 wide); set it "
        "to 0"], result.output
    raw["trainer"]["lora"] = {"rank": 8, "target_modules": ["qkv"]}
    job.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(app, ["config", "validate", str(job)])
    assert result.exit_code == 2 and "trainer.lora.target_modules" in result.stderr and "unknown target module 'qkv'" \
        in result.stderr, result.output


BF16 = ["trainer.dtype=bfloat16", "rollout.dtype=bfloat16", "coordinator.recompute_old_logprobs=true"]


def test_merged_bf16_pushes_need_a_mismatch_correction(tmp_path):
    """R3: a merged push in bf16 loses every update under half a bf16 step of W (tests/trainer/test_lora_rounding.py):
    refused without algorithm.mismatch_correction, at config time for serve merged, in the preflight for an MoE on
    CPU engines; an MoE on CUDA engines serves the adapter, so it passes."""
    base = [f"logging.out_dir={tmp_path}", "coordinator.mode=sync", "algorithm.eps=fixed"] + BF16
    with pytest.raises(ValueError, match=r"trainer.lora.serve merged: merged LoRA pushes with trainer.dtype and "
                                         r"rollout.dtype bfloat16 .* set algorithm.mismatch_correction"):
        load_config(RECIPE, base + ["trainer.lora={rank: 8, serve: merged}"])
    corrected = base + ["algorithm.mismatch_correction.level=sequence"]
    assert load_config(RECIPE, corrected + ["trainer.lora={rank: 8, serve: merged}"]).trainer.lora.serve == "merged"
    moe = _hf("qwen3_moe")
    with pytest.raises(PreflightError, match=r"trainer.lora on an MoE with CPU engines .* "
                                             r"algorithm.mismatch_correction"):
        _check(load_config(RECIPE, base + ["trainer.lora={rank: 8}"]), hf=moe)
    _check(load_config(RECIPE, corrected + ["trainer.lora={rank: 8}"]), hf=moe)
    gpu = load_config(RECIPE, base + ["trainer.lora={rank: 8}", "rollout.num_gpus_per_worker=1", "rollout.lora_rank=8"])
    _check(gpu, hf=moe)  # CUDA engines serve the MoE's adapter: no merge, no rounding; lora_rank allowed


def _deepseek_hf():
    from gspo_ray.models.tiny_deepseek import ENGINE_KEYS, deepseek_v3_config

    return deepseek_v3_config(32).to_dict() | ENGINE_KEYS


@pytest.mark.parametrize("arch, targets, extra, expected", [
    ("deepseek_v3", ["q_proj", "k_proj"], [], r"^trainer\.lora\.target_modules: 'k_proj' is not a linear of "
     r"deepseek_v3 models; valid: q_proj, q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, gate_proj, "
     r"up_proj, down_proj$"),
    ("deepseek_v3", ["q_proj", "o_proj"], [], r"^trainer\.lora\.target_modules: 'q_proj' matches no linear of this "
     r"model; its queries are q_a_proj / q_b_proj \(q_lora_rank is set\)$"),
    ("deepseek_v3", ["kv_b_proj"], ["rollout.num_gpus_per_worker=1"], r"^trainer\.lora\.target_modules: 'kv_b_proj' "
     r"with the adapter served to the engines .*set trainer\.lora\.serve merged or drop kv_b_proj$"),
    ("glm4_moe", ["q_proj", "q_a_proj"], [], r"^trainer\.lora\.target_modules: 'q_a_proj' is not a linear of "
     r"glm4_moe models; valid: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj$"),
    ("qwen2", ["kv_b_proj"], [], r"'kv_b_proj' is not a linear of qwen2 models"),
    # gpt-oss's experts are one fused tensor per projection (gate / up interleaved): attention only
    ("gpt_oss", ["q_proj", "gate_proj"], [], r"^trainer\.lora\.target_modules: 'gate_proj' is not a linear of "
     r"gpt_oss models; valid: q_proj, k_proj, v_proj, o_proj$"),
])
def test_a_target_the_family_lacks_is_refused_by_name(tmp_path, arch, targets, extra, expected):
    hf = _deepseek_hf() if arch == "deepseek_v3" else _hf(arch)
    cfg = load_config(RECIPE, [f"logging.out_dir={tmp_path}", f"trainer.lora={{rank: 8, target_modules: {targets}}}",
                               *extra])
    with pytest.raises(PreflightError, match=expected):
        _check(cfg, hf=hf)


def test_multi_latent_attention_and_shared_expert_targets_pass(tmp_path):
    """DeepSeek-V3's MLA projections and the shared experts' linears are adapter targets (CPU engines: merged
    pushes; kv_b_proj too, merged). The count: 2 layers x 5 MLA linears, 1 dense MLP x 3, 8 experts x 3 + 1 shared
    MLP x 3 in the MoE layer; GLM-4.5 with the default targets: its shared expert too."""
    targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
               "down_proj"]
    cfg = load_config(RECIPE, [f"logging.out_dir={tmp_path}", f"trainer.lora={{rank: 8, target_modules: {targets}}}"])
    report = _check(cfg, hf=_deepseek_hf())
    assert any("on 40 linears" in line and "merged full-weight pushes" in line for line in report.lines()), \
        report.lines()
    glm = load_config(RECIPE, [f"logging.out_dir={tmp_path}", "trainer.lora={rank: 8}"])  # the default targets
    assert any("on 26 linears" in line for line in _check(glm, hf=_hf("glm4_moe")).lines())  # 4 + 4 + 3 + 12 + 3


def test_without_q_lora_rank_the_mla_queries_are_q_proj(tmp_path):
    """DeepSeek-V2-Lite-style MLA (no q_lora_rank): q_proj is Megatron's linear_q_proj, H -> heads x (nope + rope)."""
    from gspo_ray.models.tiny_deepseek import ENGINE_KEYS, deepseek_v3_config

    hf = deepseek_v3_config(32, q_lora_rank=None).to_dict() | ENGINE_KEYS
    job = load_config(RECIPE, [f"logging.out_dir={tmp_path}",
                               "trainer.lora={rank: 8, target_modules: [q_proj, kv_a_proj_with_mqa]}"])
    report = _check(job, hf=hf)
    assert any("on 4 linears" in line for line in report.lines()), report.lines()
    shapes = expected_adapter_shapes(spec_from_hf_config(hf, "m"), 8, ["q_proj"])
    assert shapes["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"] == (4 * (32 + 64), 8)
    with pytest.raises(PreflightError, match=r"'q_a_proj' matches no linear of this model$"):
        _check(load_config(RECIPE, [f"logging.out_dir={tmp_path}",
                                    "trainer.lora={rank: 8, target_modules: [q_a_proj, o_proj]}"]), hf=hf)
