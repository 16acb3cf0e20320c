# Two commands a new user needs: `make run` and `make test`. Both create .venv when missing.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
ARGS    ?=
# the suite runs in this many pytest-xdist workers, a test file per worker (its module fixtures built once)
TEST_WORKERS ?= 2
# the CPU build of torch: the +cpu local version exists only in local wheel folders (these
# machines: /opt/wheels, pip's find-links) and on PyTorch's CPU index, so pip cannot fall back to
# the multi-GB CUDA build PyPI serves for Linux. Elsewhere:
#   make TORCH_INDEX=https://download.pytorch.org/whl/cpu      (macOS: make TORCH=torch==2.13.0)
TORCH       ?= torch==2.13.0+cpu
TORCH_INDEX ?=

.PHONY: run test test-fast venv triton clean-venv

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned to its CPU build; pyproject's torch==2.13.0 is then already met
	$(BIN)/pip install --quiet $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) '$(TORCH)'
	# compare: NNCF, the quantize stage's accuracy-control anchor (its test runs here; the pipeline never needs it)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,compare]'
	touch $(STAMP)

venv: $(STAMP)

# The side venv tests/test_triton.py serves a package's Triton repository from: a real tritonserver 2.51
# with its Python backend (nvidia-pytriton's wheel, no Docker), onnxruntime with numpy < 2 (the Python
# backend's), pillow, tokenizers and tritonclient[http]; every package pinned in requirements-triton.txt.
# CI makes it before the tests (.ci/run); without it the test skips, saying so.
TRITON_VENV ?= .venv-triton
TRITON_STAMP := $(TRITON_VENV)/.installed

$(TRITON_STAMP): requirements-triton.txt
	rm -rf $(TRITON_VENV)
	$(PY) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements-triton.txt
	touch $(TRITON_STAMP)

triton: $(TRITON_STAMP)

# Main job on the default model: the chain (prune, tokenizer, calibrate, quantize, export), then the
# benchmark of every variant on the eval and shift splits and artifacts/summary.md.
run: $(STAMP)
	$(BIN)/python -m pipeline stage=all $(ARGS)

# the whole suite, the layering contract (pyproject's [tool.importlinter]) first
test: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

# the quick loop: everything but the `slow` tests (the real model or corpus, a chain on the tiny model, a
# command line in a subprocess: pyproject's markers); `make test` stays the one full command
test-fast: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(ARGS)

clean-venv:
	rm -rf $(VENV) .venv-macart $(TRITON_VENV)
