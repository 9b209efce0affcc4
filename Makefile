# Setup is two commands: `make generate` (or `make serve` once the gRPC service exists) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# CPU build of torch for CI and development machines; pyproject.toml accepts the GPU machine's 2.11 too.
TORCH_VERSION ?= 2.13.0
# Triton runs its kernels in interpreter mode on CI's CPU; 3.6 is the GPU machine's version.
TRITON_VERSION ?= 3.6.0
PYTEST_ARGS ?=

.PHONY: venv test test-fast generate bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION) triton==$(TRITON_VERSION)
	$(PIP) install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -q -p no:cacheprovider --timeout=900 $(PYTEST_ARGS)

generate: venv
	$(PY) -m asyncspec.cli --prompt "import os\nimport sys\n\n\ndef main(" --max-tokens 64

bench: venv
	$(PY) benchmarks/scheduler_overhead.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
