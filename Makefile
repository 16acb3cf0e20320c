# Two commands a new user needs: `make run` and `make test`. Both create .venv when missing.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
ARGS    ?=
# the CPU build of torch: the +cpu local version exists only on PyTorch's CPU index (and in local
# wheel folders), so pip cannot fall back to the multi-GB CUDA build PyPI serves for Linux.
# macOS wheels carry no +cpu: make TORCH=torch==2.13.0
TORCH       ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: run test venv clean-venv

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned to its CPU build; pyproject's torch==2.13.0 is then already met
	$(BIN)/pip install --quiet --extra-index-url $(TORCH_INDEX) '$(TORCH)'
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# Main job on the default model: baseline evaluation on the real eval split, then the built stages.
run: $(STAMP)
	$(BIN)/python -m pipeline stage=all $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

clean-venv:
	rm -rf $(VENV) .venv-macart
