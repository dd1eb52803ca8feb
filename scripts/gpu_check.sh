#!/usr/bin/env bash
# The trainer on one lent GPU machine (torch + megatron-core only; see gspo_ray/bench/gpu_check.py): attention by
# segment on CUDA against the CPU, group rows against padded rows, a GSPO step with group rows in bf16 with and
# without LoRA, peak GPU memory at 1k / 4k / 16k-token completions; first, what ran: the layers (Transformer Engine or
# local), MoE experts (grouped GEMM or not, on a small MoE built there too), the attention kernel, the SDPA backends
# accepting our calls. One printed table; <= 8 minutes on one H100.
#   scripts/gpu_check.sh            # or: make gpu-check
#   scripts/gpu_check.sh --small    # a 2-layer dry run, anywhere
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 480 "$PY" -m gspo_ray.bench.gpu_check "$@"
