#!/usr/bin/env bash
# The trainer on one lent GPU machine (torch + megatron-core only; see gspo_ray/bench/gpu_check.py): attention by
# segment on CUDA against the CPU, group rows against padded rows, te_thd on packed rows (where Transformer Engine
# imports), a bf16 GSPO step with group rows, peak GPU memory at 1k / 4k / 16k-token completions; first, what ran:
# the layers (Transformer Engine or local), MoE experts, the attention kernel, the SDPA backends accepting our calls.
# One table, each row printed as it finishes; <= 8 minutes on one H100. Without CUDA it refuses unless --small.
#   scripts/gpu_check.sh --wheels DIR     # or: make gpu-check ARGS="--wheels DIR"
#   scripts/gpu_check.sh --small          # a 2-layer dry run, anywhere
#
# The machine's image has Python 3.12, torch, numpy and packaging; megatron-core travels as a wheel (2.6 MB), fetched
# where pip reaches the index:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d DIR megatron-core==0.16.1
# --wheels DIR installs every wheel in DIR (no index, no dependencies) into a scratch folder put first on
# PYTHONPATH. The trainer-worker rows also need pydantic (the job config; safetensors is in the image): add
# pydantic, pydantic-core, annotated-types and typing-inspection to DIR the same way, or those two rows say skipped.
# The interpreter: $PYTHON, else python3 (a CPU venv is never picked up on its own).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels)
            [ -d "${2:-}" ] || { echo "gpu_check.sh: --wheels needs a folder of wheels, got '${2:-}'" >&2; exit 2; }
            site="${TMPDIR:-/tmp}/gspo-gpu-check-site"
            rm -rf "$site"
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$2"/*.whl
            export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
            shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout 480 "$PY" -m gspo_ray.bench.gpu_check ${args[@]+"${args[@]}"}
