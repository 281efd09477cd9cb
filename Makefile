# Two commands on a fresh machine with Python 3.11+:
#   make up    start the whole stack on the embedded PostgreSQL
#   make test  run every test
#   make soak  the failover and fault suites at soak size (300-Run replica load)
# All bootstrap a private toolchain (.tools/, pinned uv) and the locked
# virtualenv (.venv/, from uv.lock) first; nothing is installed globally.

PYTHON ?= python3
UV_VERSION := 0.13.9
UV := .tools/bin/uv
export UV_PYTHON_DOWNLOADS := never
export UV_PROJECT_ENVIRONMENT := $(CURDIR)/.venv

.PHONY: up test soak lint generate bootstrap

bootstrap: .venv/.synced

.tools/bin/uv:
	$(PYTHON) -m venv .tools
	.tools/bin/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

.venv/.synced: .tools/bin/uv uv.lock pyproject.toml proto/pyproject.toml services/*/pyproject.toml clients/*/pyproject.toml
	$(UV) sync --frozen --all-packages --python $(PYTHON)
	touch $@

up: bootstrap
	.venv/bin/qinglong up

# One pytest worker per core this process may use (pytest-xdist; tests/conftest.py counts
# them), each with its own embedded PostgreSQL servers; a file's tests stay together.
test: bootstrap
	.venv/bin/python -m pytest -n auto --dist loadfile

# The replica load at 300 Runs (QINGLONG_SOAK_RUNS) and the promotion load at 50 Runs,
# with every failover and fault scenario; `make test` runs the same tests smaller.
SOAK_RUNS ?= 300
soak: bootstrap
	QINGLONG_SOAK_RUNS=$(SOAK_RUNS) .venv/bin/python -m pytest tests/failover tests/faults -s

lint: bootstrap
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

generate: bootstrap
	.venv/bin/python scripts/generate_protos.py
