# `make demo` and `make test` each set up .venv from a clean clone, then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU build of torch where no CUDA driver is present (a plain `torch` would pull a CUDA build).
	$(PY) -c "import torch" 2>/dev/null || { \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch; \
	  else $(PIP) install -q torch==2.13.0; fi; }
	$(PIP) install -q -e '.[test]'
	# build the fused CPU kernels now (~15 s, cached by torch); on failure linattn warns and uses torch ops
	$(PY) -c "from linattn.ops import native; native.load()"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/linattn demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2

bench: $(STAMP)
	$(PY) benchmarks/ops_core.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .hypothesis
