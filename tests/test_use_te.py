"""trainer.use_te: true on a machine without CUDA (this one) is one line naming the field and what is missing,
exit 2, before Ray starts (the preflight); auto resolves to the local layers here."""
from __future__ import annotations

import subprocess
import sys

from gspo_ray.trainer.model_spec import te_missing


def test_use_te_true_without_cuda_is_refused_by_the_preflight():
    code = "import sys\nfrom gspo_ray.cli.main import main\nsys.argv = ['gspo-ray', *sys.argv[1:]]\nmain()\n"
    out = subprocess.run([sys.executable, "-c", code, "config", "validate", "gspo_ray/recipes/tiny_moe.yaml",
                          "trainer.use_te=true"], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and "trainer.use_te" in lines[0] and "no CUDA device" in lines[0], lines
    assert te_missing() == "no CUDA device"


def test_te_attention_kernel_without_transformer_engine_is_refused_naming_the_field():
    import pytest

    from gspo_ray.preflight.job import check_use_te
    from gspo_ray.preflight.model import PreflightError

    check_use_te("auto", "sdpa")  # the default: any device
    for use_te, why in (("auto", "no CUDA device"), (False, "trainer.use_te is false")):
        with pytest.raises(PreflightError) as err:
            check_use_te(use_te, "te_thd")
        assert str(err.value).startswith("trainer.attention_kernel: te_thd") and why in str(err.value)
