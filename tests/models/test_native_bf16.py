"""`dtype: auto` (gspo_ray/models/native_bf16.py): bf16 where the device computes it natively, from flag sets; the
job's lines; a forced bf16 on a CPU without it warned with the measured slowdown, never refused."""
from pathlib import Path

import pytest

from gspo_ray.config import ConfigError, load_config
from gspo_ray.models.native_bf16 import auto_dtype, cpu_flags, resolve_job_dtypes, resolve_pool_dtypes

RECIPE = Path(__file__).resolve().parents[2] / "gspo_ray" / "recipes" / "tiny_moe.yaml"
EPYC = {"fpu", "avx2", "avx512f", "avx512bw"}  # an AMD EPYC without avx512_bf16 (this host's kind)


@pytest.mark.parametrize("cuda,flags,cuda_bf16,expected", [
    (False, EPYC, None, "float32"),
    (False, EPYC | {"amx_bf16", "amx_tile"}, None, "bfloat16"),  # Intel Sapphire Rapids on
    (False, EPYC | {"avx512_bf16"}, None, "bfloat16"),           # Cooper Lake, Zen 4
    (False, set(), None, "float32"),                             # no /proc/cpuinfo
    (True, EPYC, True, "bfloat16"),                              # a CUDA pool: the GPU decides, not the CPU
    (True, set(), None, "bfloat16"),                             # a driver without CUDA: assumed Ampere on
    (True, EPYC | {"amx_bf16"}, False, "float32"),               # a GPU before compute capability 8.0
])
def test_auto_resolves_from_the_device(cuda, flags, cuda_bf16, expected):
    assert auto_dtype(cuda, flags, cuda_bf16)[0] == expected


def test_the_job_lines_say_what_auto_became_and_why():
    resolved, lines = resolve_pool_dtypes({"rollout": ("auto", False), "trainer": ("float32", False)}, EPYC,
                                          "AMD EPYC", slowdown=lambda: pytest.fail("no bf16 pool: nothing timed"))
    assert resolved == {"rollout": "float32", "trainer": "float32"}
    assert lines == ["rollout.dtype auto -> float32 (AMD EPYC: no amx_bf16/avx512_bf16)"]
    resolved, lines = resolve_pool_dtypes({"rollout": ("auto", False), "trainer": ("auto", True)},
                                          EPYC | {"amx_bf16"}, "Intel Xeon", cuda_bf16=lambda: True)
    assert resolved == {"rollout": "bfloat16", "trainer": "bfloat16"}
    assert lines == ["rollout.dtype auto -> bfloat16 (Intel Xeon: amx_bf16)", "trainer.dtype auto -> bfloat16 (CUDA)"]


def test_forced_bf16_on_a_cpu_without_it_is_a_warning_with_the_slowdown():
    resolved, lines = resolve_pool_dtypes({"rollout": ("bfloat16", False), "trainer": ("bfloat16", False)}, EPYC,
                                          "AMD EPYC", slowdown=lambda: 28.0)
    assert resolved == {"rollout": "bfloat16", "trainer": "bfloat16"}  # kept: not refused
    assert lines == ["warning: rollout.dtype and trainer.dtype bfloat16 on AMD EPYC (no amx_bf16/avx512_bf16): a "
                     "bf16 matmul runs 28x slower than fp32 here (measured now, 128^3); float32 or auto is faster "
                     "on this host"]
    # native bf16, or bf16 on CUDA: nothing to say
    assert resolve_pool_dtypes({"rollout": ("bfloat16", False), "trainer": ("bfloat16", True)},
                               EPYC | {"avx512_bf16"}, "x", slowdown=lambda: pytest.fail("timed"))[1] == []


def test_the_config_takes_auto_and_keeps_float32_by_default(monkeypatch):
    monkeypatch.delenv("GSPO_RAY_AUTO_DTYPE", raising=False)
    cfg = load_config(RECIPE, ["rollout.dtype=auto", "trainer.dtype=auto"])
    assert (cfg.rollout.dtype, cfg.trainer.dtype) == ("auto", "auto")  # resolved at job start, not here
    plain = load_config(None, [])
    assert (plain.rollout.dtype, plain.trainer.dtype) == ("float32", "float32")  # tests do not change with the host
    resolved, lines = resolve_job_dtypes(cfg, slowdown=lambda: 1.0)
    assert {resolved.rollout.dtype, resolved.trainer.dtype} <= {"float32", "bfloat16"} and len(lines) == 2
    assert cfg.rollout.dtype == "auto"  # a resolved copy; the loaded config is left as written
    assert resolve_job_dtypes(plain)[0] is plain


def test_the_environment_pins_auto_at_load_whatever_the_host(monkeypatch):
    """tests/conftest.py pins float32: an AMX host runs the suite's recipe jobs as this one does."""
    monkeypatch.setenv("GSPO_RAY_AUTO_DTYPE", "float32")
    cfg = load_config(RECIPE, ["trainer.dtype=bfloat16"])
    assert (cfg.rollout.dtype, cfg.trainer.dtype) == ("float32", "bfloat16")  # a set dtype is never pinned
    monkeypatch.setenv("GSPO_RAY_AUTO_DTYPE", "fp16")
    with pytest.raises(ConfigError, match="GSPO_RAY_AUTO_DTYPE='fp16' in the environment; valid: float32, bfloat16"):
        load_config(RECIPE, [])


def test_cpu_flags_read_the_first_processor(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t: fpu\n")
    assert cpu_flags(info) == {"fpu", "avx2", "amx_bf16"} and cpu_flags(tmp_path / "none") == set()

