#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs kv8's main job: generate text from the default model
# (SmolLM2-135M-Instruct) with an FP8 KV cache. Extra arguments go to `kv8 generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then
    set -- "London is the capital of" --kv-cache-dtype fp8 --max-tokens 32
fi
exec .venv/bin/kv8 -v generate "$@"
