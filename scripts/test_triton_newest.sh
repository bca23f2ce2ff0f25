#!/usr/bin/env bash
# kv8's Triton kernel tests in the interpreter of the newest Triton kv8 allows (scripts/constraints/
# triton-newest.txt), beside the suite's run on the oldest (the CPU channel's, scripts/setup.sh). CI runs it after
# scripts/test.sh (.ci/run). Extra arguments go to pytest.
#
# It runs .venv's interpreter (scripts/setup.sh makes it: torch 2.13.0's CPU build and kv8's dependencies) with
# that Triton alone installed into .cache/triton-newest (idempotent, no dependencies: Triton has none that kv8's
# tests use), which comes first on PYTHONPATH, so .venv keeps its own. What runs (CI's time is short on a 2-core
# machine): every test of the store kernel and of caches whose K and V differ in format (store and attention,
# tests/kernels/test_triton_kv_pairs.py), the triton backend's contract tests (every cache dtype, scale mode,
# window and rotation through the backend), and the attention kernel's exact-decode (FP8, int8, int4 and fp4_e2m1)
# and sm_90 compile checks; .venv's run keeps the attention kernel's grids on the oldest Triton. What it costs:
# docs/benchmarks.md, "The Triton kernel tests on the newest Triton".
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=.venv/bin/python
TARGET=.cache/triton-newest
PAIR=scripts/constraints/triton-newest.txt
WANT=$(sed -n 's/^triton==//p' "$PAIR")
if [ ! -x "$VPY" ]; then
    echo "test_triton_newest: no .venv; run scripts/setup.sh first (scripts/test.sh does)" >&2
    exit 1
fi
have() { PYTHONPATH="$TARGET" "$VPY" -c "import triton; print(triton.__version__)" 2>/dev/null || true; }
if [ "$(have)" != "$WANT" ]; then
    rm -rf "$TARGET"
    if ! "$VPY" -m pip install -q --disable-pip-version-check --no-deps --target "$TARGET" "triton==$WANT" 2>&1 \
            | { grep -v "is ignored" || true; }; then
        echo "test_triton_newest: 'pip install triton==$WANT' failed (see above)" >&2
        exit 1
    fi
fi
export TRITON_INTERPRET=1 PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
"$VPY" -c "import torch, triton; print('test_triton_newest: torch', torch.__version__, '| triton', triton.__version__, \
'from', triton.__file__)"
# -k triton: the whole store module (its name matches), the contract's triton cases, the attention tests named here
A=tests/kernels/test_triton_attention.py
exec "$VPY" -m pytest -q -p no:cacheprovider tests/kernels/test_triton_store.py tests/kernels/test_triton_kv_pairs.py \
    tests/attention/test_backend_contract.py \
    "$A::test_bit_decode_is_exact_for_every_code" "$A::test_mixed_batch_launches_decode_rows_apart" \
    "$A::test_int8_decode_is_exact_for_every_code" "$A::test_int4_decode_unpacks_every_byte" \
    "$A::test_fp4_decode_is_exact_for_every_code_and_scale_byte" \
    "$A::test_kernels_compile_for_sm90_without_spills" -k triton "$@"
