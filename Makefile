# Two entry points for a fresh machine (see README.md): `make run` and `make test`.
# Everything is installed into .venv from this repository's own pyproject.toml.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: run test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The runtime install (ray, numpy, msgpack, matplotlib): enough for the main job.
$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

# Tests also need the dev tools and the compile extra (apache-tvm, onnx, torch CPU).
$(VENV)/.dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev,compile]'
	touch $@ $(VENV)/.runtime

run: $(VENV)/.runtime
	$(BIN)/tvmpipe run --stages 2 --local

test: $(VENV)/.dev
	$(BIN)/python -m pytest

bench: $(VENV)/.dev
	for b in bench/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache
