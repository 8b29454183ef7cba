# `make demo` and `make test` each set up .venv from a clean clone, then run.
# They install exactly the versions in requirements.txt (made by `make lock`, pip-tools);
# `make test-latest` runs the suite against the newest releases pyproject.toml allows instead.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
LOCK   := requirements.txt
TORCH  := requirements/torch.txt
LATEST := .venv-latest

.PHONY: demo test test-latest lock bench clean

# torch: the lock names the CPU build (torch==X+cpu). Where a CUDA driver is present the same version
# comes from PyPI (a CUDA build) and the rest of the lock is installed around it.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import sys; v = sys.version_info[:2]; v == (3, 11) or print(f'warning: $(LOCK) was made for Python 3.11, this is {v[0]}.{v[1]}')"
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PIP) install -q -r $(TORCH) && grep -v '^torch==' $(LOCK) > $(VENV)/lock-without-torch.txt && \
	  $(PIP) install -q -r $(VENV)/lock-without-torch.txt; \
	else $(PIP) install -q -r $(LOCK); fi
	$(PIP) install -q --no-deps -e .
	$(PIP) check
	# build the fused CPU kernels now (~15 s, cached by torch); on failure linattn warns and uses torch ops
	$(PY) -c "from linattn.ops import native; native.load()"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/linattn demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2

# The newest releases pyproject.toml allows (torch stays at requirements/torch.txt: other versions pull a
# CUDA build of several GB), in a venv of its own; prints what it resolved, then runs the suite.
test-latest:
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q -r $(TORCH)
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -c $(TORCH) -e '.[test,hf]'
	$(LATEST)/bin/python requirements/drift.py $(LOCK)
	$(LATEST)/bin/python -m pytest -q -n 2

# Re-resolve the lock from pyproject.toml (run after changing a dependency, or to move to newer peers
# once `make test-latest` passes). pip-tools is pinned here so that the lock's format does not drift.
# `make lock UPGRADE=` keeps every pin the lock has and only adds what pyproject.toml newly asks for.
UPGRADE ?= --upgrade
lock:
	test -x .venv-lock/bin/pip-compile || { $(PYTHON) -m venv .venv-lock && .venv-lock/bin/pip install -q pip-tools==7.7.0; }
	.venv-lock/bin/pip-compile -q $(UPGRADE) --strip-extras --no-emit-index-url --no-emit-find-links \
	  --extra test --extra hf -c $(TORCH) -o $(LOCK) pyproject.toml

bench: $(STAMP)
	$(PY) benchmarks/ops_core.py

clean:
	rm -rf $(VENV) $(LATEST) .venv-lock build *.egg-info src/*.egg-info .pytest_cache .hypothesis
