"""The megatron-core import workaround (gspo_ray/compat/megatron_import.py), in fresh processes: still needed (a
plain import pulls torch._dynamo in), still working (the guarded one does not, and leaves torch.compile as it was),
and still harmless (the trainer's Megatron config keeps every fused kernel off, so no jit_fuser kernel runs)."""
import json
import subprocess
import sys

PLAIN = """
import json, sys
import megatron.core
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules,
                  "eager_kernel": bias_swiglu.__code__.co_name == "bias_swiglu"}))
"""

GUARDED = """
import json, sys
import torch
compile_ = torch.compile
from gspo_ray.compat.megatron_import import megatron_core
from megatron.core.jit import jit_fuser
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
from gspo_ray.trainer.model import build_transformer_config
from gspo_ray.trainer.model_spec import read_hf_config, spec_from_hf_config
spec = spec_from_hf_config(read_hf_config(sys.argv[1]), sys.argv[1])
tc = build_transformer_config(spec)
fusions = {k: getattr(tc, k) for k in ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
                                       "apply_rope_fusion", "gradient_accumulation_fusion", "moe_permute_fusion",
                                       "moe_grouped_gemm")}
def f(x):
    return x
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "identity": jit_fuser(f) is f,
                  "eager_kernel": bias_swiglu.__code__.co_name == "bias_swiglu", "restored": torch.compile is compile_,
                  "fusions": fusions}))
"""


def _run(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_plain_import_of_megatron_core_pulls_in_torch_dynamo():
    # When this fails, megatron-core no longer imports the compiler stack: delete the workaround.
    seen = _run(PLAIN)
    assert seen["dynamo"] is True and seen["eager_kernel"] is False, seen  # its kernels are torch.compile wrappers


def test_the_guarded_import_skips_the_compiler_and_every_fusion_stays_off(tiny_moe_dir):
    seen = _run(GUARDED, str(tiny_moe_dir))
    assert seen["dynamo"] is False and seen["identity"] and seen["eager_kernel"] and seen["restored"], seen
    assert not any(seen["fusions"].values()), seen["fusions"]
