#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh), checks the package with ruff, mypy and import-linter (the layers and the
# absence of import cycles; all configured in pyproject.toml), then runs the full test suite. Extra arguments go
# to pytest, e.g. `bash scripts/test.sh -m "not slow"` for the fast inner loop.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check kv8 tests benchmarks scripts
.venv/bin/mypy
.venv/bin/lint-imports --no-cache
exec .venv/bin/python -m pytest -q "$@"
