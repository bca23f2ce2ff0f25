#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the full test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
