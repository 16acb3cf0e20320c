# Two commands a new user needs: `make run` and `make test`. Both create .venv when missing.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
ARGS    ?=

.PHONY: run test venv clean-venv

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: the CPU wheel on local disk; anything looser pulls CUDA.
	$(BIN)/pip install --quiet torch==2.13.0
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
