"""make gpu-check (gspo_ray/bench/gpu_check.py), run here on the CPU: its probe of torch's SDPA backends, and the whole
`--small` check under an import guard that refuses what a lent GPU machine does not have, so an import that the
bare machine lacks cannot slip into the check unnoticed."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_ray.bench.gpu_check import check_sdpa_backends, main

ROOT = Path(__file__).resolve().parents[2]

# What a lent GPU machine has for the check: the standard library, the project, torch (with what torch itself
# imports: its declared dependencies, and triton on CUDA), and megatron-core with its declared dependencies
# (numpy, packaging); scripts/gpu_check.sh --wheels lists no others. Everything else is refused, including what
# megatron-core and torch import optionally here (einops, wandb, tensorboard, yaml, tqdm, ...): they are absent there.
ALLOWED = {"gspo_ray", "torch", "torchgen", "functorch", "typing_extensions", "sympy", "mpmath", "networkx", "jinja2",
           "markupsafe", "fsspec", "filelock", "triton",
           "setuptools", "_distutils_hack", "jaraco", "more_itertools", "backports",  # setuptools and what it vendors
           "megatron", "numpy", "packaging"}
# (importer, module): optional imports the project itself probes and copes without (each a "skipped: ..." row):
# Transformer Engine where CUDA is there, pydantic for the trainer-worker rows (gpu_check runs as __main__)
PROBED = {("gspo_ray.trainer.model_spec", "transformer_engine"), ("gspo_ray.trainer.model", "transformer_engine"),
          ("__main__", "pydantic")}

GUARD = """
import importlib.machinery as m, json, runpy, sys
allowed = set(sys.stdlib_module_names) | set(json.loads(sys.argv[1]))
refused = []
# In front of each of Python's path finders: a top-level module outside `allowed` is not found, as on a machine
# without it (imports raise ModuleNotFoundError, importlib.util.find_spec probes get None); which module asked
# (the first frame outside importlib) is noted.
class Guard:
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in allowed or top.startswith("_sysconfigdata"):  # sysconfig's own data module, named per build
            return self.finder.find_spec(name, path, target)
        f = sys._getframe(1)
        while f is not None and (f.f_code.co_filename.startswith("<frozen") or "importlib" in f.f_code.co_filename):
            f = f.f_back
        refused.append([f.f_globals.get("__name__", "?") if f is not None else "?", top])
        return None
    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()
builtin = (m.BuiltinImporter, m.FrozenImporter)
sys.meta_path[:] = [f if f in builtin else Guard(f) for f in sys.meta_path]
sys.argv = ["gpu_check", "--small"]
try:
    runpy.run_module("gspo_ray.bench.gpu_check", run_name="__main__", alter_sys=True)
finally:
    print("import-guard refused: " + json.dumps(refused), file=sys.stderr, flush=True)
"""


def test_sdpa_backend_probe_on_cpu():
    accepted = check_sdpa_backends("cpu")
    assert set(accepted) == {"bfloat16", "float32"}
    for ok in accepted.values():
        assert "math" in ok  # the reference backend takes every input
        assert "efficient" not in ok and "cudnn" not in ok  # CUDA kernels: refused on a CPU tensor


def table_rows(stdout: str) -> dict[str, dict[str, str]]:
    """The printed table's rows by check name, each {column: cell}."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[1:]]
    return {r["check"]: r for r in rows}


def test_small_check_runs_with_torch_and_megatron_alone():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", GUARD, json.dumps(sorted(ALLOWED))], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused = json.loads(proc.stderr.rsplit("import-guard refused: ", 1)[1].splitlines()[0])
    # the project's modules, gpu_check itself included (it runs as __main__)
    ours = {(importer, top) for importer, top in refused if importer.startswith("gspo_ray") or importer == "__main__"}
    assert ours <= PROBED, f"the check imports {ours - PROBED}, which a lent GPU machine lacks"
    rows = table_rows(proc.stdout)
    errors = {name: r["error"] for name, r in rows.items() if r["error"] != "-"}
    skipped = {name for name, e in errors.items() if e.startswith("skipped: ")}
    assert errors.keys() == skipped, errors  # every row ran, or says why it could not here
    # on a CPU: Transformer Engine's rows skip (no CUDA), the worker's (no pydantic under the guard); the rest ran
    assert skipped == {"TE fused attention (THD) vs SDPA (bf16)", "te_thd packed group rows vs padded rows (bf16)",
                       "te_thd packed samples vs padded rows (bf16)", "GSPO step, group rows, bf16, trainer worker",
                       "GSPO step, group rows, bf16, trainer worker, LoRA"}, errors
    assert "pydantic not importable" in errors["GSPO step, group rows, bf16, trainer worker"]
    step = rows["GSPO step, group rows, bf16 (trainer parts)"]
    assert step["finite"] == "True" and float(step["loss"]) == float(step["loss"])
    for name in ("group rows vs padded rows (log-probs, fp32)", "MoE group rows vs padded rows (log-probs, fp32)"):
        assert float(rows[name]["max abs diff"]) < 1e-4, rows[name]


def test_full_size_check_refuses_a_cpu_torch(capsys):
    with pytest.raises(SystemExit) as stop:  # this machine's torch has no CUDA, as the CPU venv's
        main([])
    assert stop.value.code == 2 and "sees no CUDA device" in capsys.readouterr().err
