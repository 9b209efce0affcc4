# Setup is two commands: `make serve` (the gRPC server on the bundled model pair) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# CPU build of torch for CI and development machines; pyproject.toml accepts the GPU machine's 2.11 too.
TORCH_VERSION ?= 2.13.0
# Triton runs its kernels in interpreter mode on CI's CPU; 3.6 is the GPU machine's version.
TRITON_VERSION ?= 3.6.0
# Where pip finds no CPU build of torch (PyPI's Linux torch is the CUDA build, which pins another triton),
# the install retries from PyTorch's CPU index.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=
# Test workers (pytest-xdist): CI has two cores. PYTEST_WORKERS=0 runs in one process (pdb, -s, timing one test).
PYTEST_WORKERS ?= 2

.PHONY: venv test test-slow test-fast lint lint-tree lint-mypy lint-imports generate serve proto bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION) triton==$(TRITON_VERSION) || \
		$(PIP) install -q --index-url $(TORCH_CPU_INDEX) --extra-index-url https://pypi.org/simple \
			torch==$(TORCH_VERSION) triton==$(TRITON_VERSION)
	$(PIP) install -q -e '.[test,lint]'
	touch $@

venv: $(VENV)/.installed

# CI runs everything but the long settings marked slow (make test-slow runs those).
test: venv
	$(PY) -m pytest -q -p no:cacheprovider --timeout=900 -n $(PYTEST_WORKERS) --dist worksteal -m "not slow" $(PYTEST_ARGS)

test-slow: venv
	$(PY) -m pytest -q -p no:cacheprovider --timeout=1800 -m slow $(PYTEST_ARGS)

# ruff, mypy and import-linter; `.pre-commit-config.yaml` runs the same checks. lint-mypy and lint-imports
# need no venv bootstrap, so the pre-commit hooks can call them directly.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(MAKE) --no-print-directory lint-mypy lint-imports

# mypy and import-linter cannot read setuptools' package-dir mapping (kernels/ installs as asyncspec.kernels),
# so mirror the installed layout with symlinks: build/lint-tree/asyncspec/{<asyncspec entries>,kernels}.
# Rebuilt on every run (cheap), so new modules are always seen.
LINT_TREE := build/lint-tree
lint-tree:
	rm -rf $(LINT_TREE)
	mkdir -p $(LINT_TREE)/asyncspec
	for f in asyncspec/*; do ln -s "$(CURDIR)/$$f" $(LINT_TREE)/asyncspec/; done
	ln -s "$(CURDIR)/kernels" $(LINT_TREE)/asyncspec/kernels

lint-mypy: lint-tree
	$(VENV)/bin/mypy

# lint-imports puts its working directory first on sys.path: run it inside the tree so that
# `asyncspec` resolves there and asyncspec.kernels is part of the import graph.
lint-imports: lint-tree
	cd $(LINT_TREE) && $(abspath $(VENV))/bin/lint-imports --no-cache --no-logo $(CURDIR)/pyproject.toml

generate: venv
	$(VENV)/bin/asyncspec-generate --prompt "import os\nimport sys\n\n\ndef main(" --max-tokens 64

# The gRPC server on the bundled target with its draft (k = 4): port 50051, metrics on 9400.
# SERVE_ARGS adds flags, e.g. SERVE_ARGS="--device cpu --port 50052".
SERVE_ARGS ?=
serve: venv
	$(VENV)/bin/asyncspec serve $(SERVE_ARGS)

# Regenerates the Python stubs of proto/asyncspec/v1/*.proto (grpcio-tools 1.84.0, from the test extra);
# tests/server/test_proto.py fails when the committed stubs differ from a fresh generation.
proto: venv
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/asyncspec/v1/asyncspec.proto

bench: venv
	$(PY) benchmarks/scheduler_overhead.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
