# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Both create .venv on first use. On a CPU-only machine torch==2.13.0 is the CPU build that
# pip finds locally; Triton is pinned to the version the GPU machine has (3.6.0).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fastmamba-installed

.PHONY: demo test test-gpu bench-kernels clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" "triton==3.6.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

# Main job: the end-to-end decode benchmark on a preset, then a short streamed generation.
# With a GPU: mamba2-2.7b (random weights), CUDA graphs, tok/s vs the bandwidth roofline.
# Without one: the tiny preset on the CPU through the Triton interpreter (it says so).
demo: $(STAMP)
	@echo "== fastmamba demo on a preset: the shape of a public Mamba-2 model with RANDOM weights (fixed seed)."
	@echo "   It measures speed: the prompt is token ids and the tokens it prints are ids that mean nothing."
	@echo "   Text from a real checkpoint (config.json, weights, tokenizer.json):"
	@echo "   $(VENV)/bin/fastmamba generate --model DIR --prompt \"The capital of France is\""
	@if $(PY) -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(PY) -m fastmamba.bench e2e && \
		$(PY) -m fastmamba.cli generate --model mamba2-130m --prompt-ids 1,2,3,4 --max-new-tokens 32; \
	else \
		TRITON_INTERPRET=1 $(PY) -m fastmamba.bench e2e --gen-len 8 --prompt-len 8 && \
		TRITON_INTERPRET=1 $(PY) -m fastmamba.cli generate --model mamba2-tiny --prompt-ids 1,2,3,4 --max-new-tokens 8; \
	fi

# The decode-kernel benchmark (peers side by side; small interpreter shapes without a GPU).
bench-kernels: $(STAMP)
	@if $(PY) -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(PY) -m fastmamba.bench kernels; \
	else \
		TRITON_INTERPRET=1 $(PY) -m fastmamba.bench kernels; \
	fi

# CPU tests run the real Triton kernels under the interpreter; GPU-marked tests skip cleanly.
# pytest-xdist spreads them over TEST_WORKERS processes (both cores of a 2-core machine); the 20
# slowest tests are listed at the end.
TEST_WORKERS ?= 2
test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -n $(TEST_WORKERS) --durations=20 -m "not gpu" tests

# On a machine with a GPU and torch/triton already installed (no venv, no network needed).
test-gpu:
	$(PYTHON) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache
