#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh), checks the package with ruff and mypy (configured in pyproject.toml), then
# runs the full test suite. Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` for the
# fast inner loop.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check kv8 tests benchmarks scripts
.venv/bin/mypy
exec .venv/bin/python -m pytest -q "$@"
