"""Compile kv8's planned Triton launches for an H100 (sm_90) without one, and measure the compiled code.

Run as a script in a process without ``TRITON_INTERPRET`` (the tests' own process interprets the kernels)::

    python -m tests.helpers.sm90            # prints a table of the figures, then the same as JSON

:func:`compile_launch` builds a :class:`kv8.kernels.triton.launch.Launch` -- what a wrapper would pass to the kernel,
made from CPU tensors of the real shapes and strides -- with Triton's own binder (so the integer and pointer
specialisations, e.g. divisibility by 16, are the launch's), for ``GPUTarget("cuda", 90, 32)``. :func:`measure`
reads the result:

* ``registers``, ``spill_bytes``: ``ptxas -v`` (the wheel's ptxas) on the PTX;
* ``shared_bytes``: the shared memory Triton allocates for the kernel (its pipeline buffers);
* the **key loop**: the backward branch of the SASS (``cuobjdump -sass``) and of the PTX that encloses the most
  tensor-core instructions, the shortest on a tie. The attention kernel's launches with keys as the products' rows
  (FP8 decode) have two such loops: the one over the key tiles every query row sees whole (no masks; all but at
  most the last tile of a decode row) is the key loop, the other (the masked edge tiles) is reported as
  ``edge_loop_sass`` and ``edge_loop_f2f``. In the key loop:
  ``loop_sass`` instructions (one warp's instructions per iteration), how many are ``F2F`` (scalar float
  conversions), ``F2FP`` (packed conversions), ``HMMA``/``HGMMA``, ``MUFU``, ``BAR``; and from the PTX the
  ``cp.async.wait_group`` counts (``wait_groups``: a count above 0 leaves later tiles' loads in flight while this
  one is used -- pipelining), the sizes of its ``cp.async`` copies (``async_copy_bytes``: 4, 8 or 16 bytes a
  thread; wider is fewer instructions per KB) and the FP8 conversions of both loops (``cvt_fp8_packed``, e.g.
  ``cvt.rn.f16x2.e4m3x2``, and ``cvt_fp8_scalar``);
* ``instr_per_kb``: ``loop_sass * num_warps`` (the warp instructions an SM issues per iteration) over the KB of
  K and V cache one iteration reads (``bytes_per_iter``, given by the caller).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any


def _tool(name: str) -> str:
    """A binary of Triton's wheel (ptxas, cuobjdump), by path; Triton is imported only here and below, so the
    checks of :func:`violations` run where it is absent."""
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _ptxas() -> str:
    """The ptxas Triton itself runs for sm_90 (the wheel's ``ptxas`` on Triton 3.6; 3.9 emits PTX 9.4, which only
    its newer bundled one reads)."""
    from triton.backends.nvidia.compiler import get_ptxas
    return str(get_ptxas(90).path)


def tools_missing() -> str | None:
    """Why this machine cannot compile for sm_90 (None when it can): no Triton, no NVIDIA backend, no ptxas or
    cuobjdump."""
    try:
        import triton.backends.nvidia  # noqa: F401
        from triton.runtime.jit import create_function_from_signature  # noqa: F401
    except ImportError as exc:
        return f"Triton with its NVIDIA backend is not importable: {exc}"
    for name in ("ptxas", "cuobjdump"):
        if not os.access(_tool(name), os.X_OK):
            return f"{_tool(name)} is missing (Triton's wheel ships it for Linux x86-64)"
    return None


def compile_launch(launch: Any, arch: int = 90) -> Any:
    """The launch's kernel compiled for ``sm_<arch>`` exactly as ``launch.run()`` would compile it on that GPU."""
    return compile_for_target(launch, "cuda", arch, 32)


def compile_for_target(launch: Any, backend_name: str, arch: int | str, warp_size: int) -> Any:
    """The launch's kernel compiled for Triton's target ``(backend_name, arch, warp_size)`` as ``launch.run()``
    would compile it there (binding the launch's arguments as the JIT does); also :mod:`tests.helpers.gfx942`'s."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    target = GPUTarget(backend_name, arch, warp_size)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, dict(launch.kwargs), bound, specialization,
                                                          options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


@dataclass
class Figures:
    registers: int
    spill_bytes: int
    shared_bytes: int
    num_warps: int
    num_stages: int
    loop_sass: int
    loop_f2f: int
    loop_f2fp: int
    loop_mma: int
    loop_mufu: int
    loop_bar: int
    edge_loop_sass: int
    edge_loop_f2f: int
    wait_groups: list[int]
    async_copy_bytes: list[int]
    cvt_fp8_packed: list[str]
    cvt_fp8_scalar: list[str]
    bytes_per_iter: int
    instr_per_kb: float


def _loops(lines: list[str], is_label: Any, branch_target: Any) -> list[tuple[int, int]]:
    """(first, last) line index of every loop: a branch to a label at or before it."""
    where = {}
    for i, line in enumerate(lines):
        name = is_label(line)
        if name is not None:
            where[name] = i
    loops = []
    for i, line in enumerate(lines):
        name = branch_target(line)
        if name is not None and name in where and where[name] <= i:
            loops.append((where[name], i))
    return loops


def _key_loops(lines: list[str], loops: list[tuple[int, int]], is_mma: Any) -> list[list[str]]:
    """The loops with the most tensor-core instructions (none that encloses another of them), shortest first: the
    attention kernel's key loop over whole tiles, then its loop over the edge tiles (masked)."""
    counts = [(sum(1 for line in lines[lo:hi + 1] if is_mma(line)), lo, hi) for lo, hi in loops]
    most = max((n for n, _, _ in counts), default=0)
    if not most:
        return []
    best = [(lo, hi) for n, lo, hi in counts if n == most]
    inner = [(lo, hi) for lo, hi in best if not any((a, b) != (lo, hi) and lo <= a and b <= hi for a, b in best)]
    return [lines[lo:hi + 1] for lo, hi in sorted(inner, key=lambda x: x[1] - x[0])]


def _sass(cubin: bytes) -> list[str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    # "        /*0a30*/                   @!P0 BRA 0x1c10 ;" -> "0a30 @!P0 BRA 0x1c10"
    return [f"{m.group(1)} {m.group(2).strip()}" for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", out)]


def measure(kernel: Any, num_warps: int, num_stages: int, bytes_per_iter: int) -> Figures:
    """The compiled figures of ``kernel`` (module docstring); ``bytes_per_iter`` of cache per key-loop iteration."""
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        log = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                             text=True)
    finally:
        os.unlink(f.name)
    if log.returncode != 0:
        raise RuntimeError(f"ptxas failed: {log.stderr[-2000:]}")
    registers = int(re.search(r"Used (\d+) registers", log.stderr).group(1))  # type: ignore[union-attr]
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill", log.stderr))

    sass = _sass(kernel.asm["cubin"])

    def sass_label(line: str) -> str | None:
        return line.split(" ", 1)[0]

    def sass_branch(line: str) -> str | None:
        m = re.search(r"\bBRA(?:\.[A-Z.]+)? `?\(?0x([0-9a-f]+)", line)
        return m.group(1).rjust(4, "0") if m else None

    def sass_mma(line: str) -> bool:
        return re.search(r"\b(HMMA|HGMMA|IMMA|QGMMA)\b", line) is not None

    sass_loops = [[op for op in (line.split(" ", 1)[1] for line in lines) if not op.startswith("NOP")]
                  for lines in _key_loops(sass, _loops(sass, sass_label, sass_branch), sass_mma)]
    loop = sass_loops[0] if sass_loops else []
    edge = sass_loops[1] if len(sass_loops) > 1 else []

    ptx_lines = [line.strip() for line in ptx.splitlines()]

    def ptx_label(line: str) -> str | None:
        m = re.match(r"(\$L__\w+):", line)
        return m.group(1) if m else None

    def ptx_branch(line: str) -> str | None:
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line)
        return m.group(1) if m else None

    ptx_loops = _key_loops(ptx_lines, _loops(ptx_lines, ptx_label, ptx_branch),
                           lambda line: re.match(r"(@%p\d+ )?(w?g?mma)\b", line) is not None)
    ptx_text = "\n".join(ptx_loops[0]) if ptx_loops else ""
    fp8_cvts = re.findall(r"cvt\.[a-z0-9.]*e[45]m[23][a-z0-9.]*", "\n".join(sum(ptx_loops, [])))

    def count(prefix: str, ops: list[str] = loop) -> int:
        return sum(1 for op in ops if re.match(rf"(@!?U?P\w+ )?{prefix}\b", op))

    kb = bytes_per_iter / 1024
    return Figures(
        registers=registers, spill_bytes=spills, shared_bytes=int(kernel.metadata.shared), num_warps=num_warps,
        num_stages=num_stages, loop_sass=len(loop), loop_f2f=count("F2F"), loop_f2fp=count("F2FP"),
        loop_mma=count("(HMMA|HGMMA)"), loop_mufu=count("MUFU"), loop_bar=count("BAR"), edge_loop_sass=len(edge),
        edge_loop_f2f=count("F2F", edge),
        wait_groups=[int(x) for x in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx_text)],
        async_copy_bytes=sorted({int(x, 0) for x in re.findall(
            r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)? \[[^\]]*\], \[[^\]]*\], (0x[0-9a-f]+|\d+)", ptx_text)}),
        cvt_fp8_packed=sorted({c for c in fp8_cvts if "x2" in c}),
        cvt_fp8_scalar=sorted({c for c in fp8_cvts if "x2" not in c}),
        bytes_per_iter=bytes_per_iter,
        instr_per_kb=round(len(loop) * num_warps / kb, 1) if loop else float("nan"),
    )


# ---- the cases: Llama-3.1-8B shapes (32 query heads, 8 KV heads, head_dim 128, blocks of 16) ------------------------

def llama_attention_launches(kv: str, phase: str, compute_units: int = 132, query_dtype: str = "bfloat16"
                             ) -> list[Any]:
    """What :func:`~kv8.kernels.triton.attention.unified_attention` launches for one layer of Llama-3.1-8B on an
    H100 (132 SMs): ``kv`` "fp8_e4m3" (static per-head scales), "int8" or "int4" (codes, dynamic per-token
    scales), "int4_per_group32" (int4 codes with float16 scales per 32 values in each row), "fp4_e2m1" (E2M1 codes
    with E4M3 scales per 16 values in each row), "bfloat16", or "k8v4" (K int8 codes with their dynamic scales, V
    int4_per_group32: a cache of two formats); ``phase`` "decode" (32
    sequences at 4k context, one new token each), "prefill" (one 2048-token prompt) or "mixed" (31 decode rows at 4k
    and one 2048-token prompt). CPU tensors with the real strides; no cache-sized memory (the block count does not
    change the kernel). The lengths are passed as the engine's backend passes them (``max_query_len``,
    ``min_query_len``). ``query_dtype``: the queries' torch dtype by name (bfloat16, float16, float32)."""
    import torch

    from kv8.kernels.triton import attention as A
    from kv8.kernels.triton.formats import (
        SAME_AS_K,
        FloatGroupLayout,
        GroupLayout,
        IntLayout,
        code_width,
        kernel_format,
    )
    from kv8.platform import Platform
    from kv8.quant.formats import E4M3, INT4, INT8
    from kv8.quant.fp4 import FP4_E2M1
    from kv8.quant.int4_group import INT4_G32

    heads, kv_heads, dim, bs = 32, 8, 128, 16
    if phase == "decode":
        q_lens, ctxs = [1] * 32, [4096] * 32
    elif phase == "prefill":
        q_lens, ctxs = [2048], [2048]
    elif phase == "mixed":
        q_lens, ctxs = [1] * 31 + [2048], [4096] * 31 + [2048]
    else:
        raise ValueError(f"phase={phase!r}: allowed 'decode', 'prefill', 'mixed'")
    if kv == "k8v4":
        kv, v_kv = "int8", "int4_per_group32"
    else:
        v_kv = kv
    fp8, int8, fp4 = kv == "fp8_e4m3", kv == "int8", kv == "fp4_e2m1"
    int4, g32 = kv == "int4", kv == "int4_per_group32"
    if not (fp8 or int8 or fp4 or int4 or g32) and kv != "bfloat16":
        raise ValueError(f"kv={kv!r}: allowed 'fp8_e4m3', 'int8', 'int4', 'int4_per_group32', 'fp4_e2m1', "
                         "'bfloat16', 'k8v4'")
    packed: dict[str, IntLayout | GroupLayout | FloatGroupLayout] = {
        "fp4_e2m1": FP4_E2M1, "int4": INT4, "int4_per_group32": INT4_G32}
    codes = packed.get(kv)
    tokens = sum(q_lens)
    query = torch.zeros(tokens, heads, dim, dtype=getattr(torch, query_dtype))
    cache = (torch.zeros(16, kv_heads, bs, code_width(kernel_format(codes), dim), dtype=torch.uint8)
             if codes is not None else
             torch.zeros(16, kv_heads, bs, dim, dtype=torch.uint8 if fp8 else torch.int8 if int8 else torch.bfloat16))
    token_scales = torch.ones(16, kv_heads, bs) if int8 or int4 else None
    v_cache, v_token_scales = cache.clone(), None if token_scales is None else token_scales.clone()
    v_codes = packed.get(v_kv)
    if v_kv != kv:   # a pair: V's rows and scales of its own format (only the group formats so far)
        assert v_codes is not None
        v_cache = torch.zeros(16, kv_heads, bs, code_width(kernel_format(v_codes), dim), dtype=torch.uint8)
        v_token_scales = None
    blocks = -(-max(ctxs) // bs)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return A.plan_launches(
        query, cache, v_cache, torch.empty_like(query),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(ctxs, dtype=torch.int32),
        block_tables=torch.zeros(len(q_lens), blocks, dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(ctxs), scale=dim ** -0.5, sliding_window=None,
        fp8=E4M3 if fp8 else INT8 if int8 else codes,
        k_scale=torch.ones(kv_heads, 1) if fp8 else None, v_scale=torch.ones(kv_heads, 1) if fp8 else None,
        k_token_scales=token_scales, v_token_scales=v_token_scales,
        num_kv_splits=None, platform=Platform.cuda((9, 0), "H100", compute_units=compute_units),
        min_query_len=min(q_lens), v_fp8=v_codes if v_kv != kv else SAME_AS_K)


def llama_store_launch(kv: str) -> Any:
    """What :func:`~kv8.kernels.triton.store.store_kv` launches for one decode step of 32 sequences (8 KV heads,
    head_dim 128, blocks of 16; ``kv`` "fp8_e4m3" with static per-head scales, "int8" (dynamic scales),
    "fp4_e2m1" (its group scales in the rows), "bfloat16" or "k8v4" (K int8 with dynamic scales, V
    int4_per_group32: one launch stores both))."""
    import torch

    from kv8.kernels.triton import store as S
    from kv8.kernels.triton.formats import kernel_format
    from kv8.quant.formats import E4M3, INT8
    from kv8.quant.fp4 import FP4_E2M1
    from kv8.quant.int4_group import INT4_G32

    if kv == "k8v4":
        key = torch.zeros(32, 8, 128, dtype=torch.bfloat16)
        k_cache = torch.zeros(16, 8, 16, 128, dtype=torch.int8)
        v_cache = torch.zeros(16, 8, 16, INT4_G32.row_bytes(128), dtype=torch.uint8)
        ts = torch.ones(16, 8, 16)
        slots = torch.arange(32, dtype=torch.int64)
        return S.store_launch(key, key.clone(), k_cache, v_cache, slots, slots, slots, ts, slots, (0, 0, 0, 0),
                              (*ts.stride(), 0, 0, 0), mode=2, fmt=kernel_format(INT8), v_mode=3,
                              v_fmt=kernel_format(INT4_G32))
    if kv == "fp4_e2m1":
        key = torch.zeros(32, 8, 128, dtype=torch.bfloat16)
        cache = torch.zeros(16, 8, 16, FP4_E2M1.row_bytes(128), dtype=torch.uint8)
        slots = torch.arange(32, dtype=torch.int64)
        return S.store_launch(key, key.clone(), cache, cache.clone(), slots, slots, slots, slots, slots,
                              (0, 0, 0, 0), (0, 0, 0) * 2, mode=3, fmt=kernel_format(FP4_E2M1))

    if kv == "int8":
        key = torch.zeros(32, 8, 128, dtype=torch.bfloat16)
        cache = torch.zeros(16, 8, 16, 128, dtype=torch.int8)
        ts = torch.ones(16, 8, 16)
        slots = torch.arange(32, dtype=torch.int64)
        return S.store_launch(key, key.clone(), cache, cache.clone(), slots, slots, slots, ts, ts.clone(),
                              (0, 0, 0, 0), ts.stride() * 2, mode=2, fmt=kernel_format(INT8))
    fp8 = kv == "fp8_e4m3"
    key = torch.zeros(32, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(16, 8, 16, 128, dtype=torch.uint8 if fp8 else torch.bfloat16)
    slots = torch.arange(32, dtype=torch.int64)
    scale = torch.ones(8, 1).expand(8, 128)
    placeholder = slots
    return S.store_launch(key, key.clone(), cache, cache.clone(), slots,
                          scale if fp8 else placeholder, scale if fp8 else placeholder, placeholder, placeholder,
                          (scale.stride(0), scale.stride(1)) * 2 if fp8 else (0, 0, 0, 0), (0, 0, 0) * 2,
                          mode=1 if fp8 else 0, fmt=kernel_format(E4M3) if fp8 else None)


def attention_launch(kv: str, phase: str, query_dtype: str = "bfloat16") -> Any:
    """The attention kernel's launch that serves the phase's rows: the decode batch's one launch, the prefill
    chunk's launch (the same kernel as a mixed batch's prefill launch; the pure prefill batch makes no decode
    launch)."""
    launches = [x for x in llama_attention_launches(kv, phase, query_dtype=query_dtype) if "Q_LEN_MIN" in x.kwargs]
    return launches[0] if phase == "decode" else next(x for x in launches if x.kwargs["Q_LEN_MIN"] > 0)


def attention_figures(launch: Any) -> Figures:
    """:func:`measure` of an attention launch; an iteration reads TILE_N keys of K and V of one KV head (a row of each
    cache: ``head_dim`` elements, or a packed format's row of codes and group scales; K's and V's own)."""
    kw = launch.kwargs
    row_bytes = sum(c.shape[-1] * c.element_size() for c in launch.args[2:4])   # k_cache, v_cache
    return measure(compile_launch(launch), int(kw["num_warps"]), int(kw.get("num_stages", 3)),
                   int(kw["TILE_N"]) * row_bytes)


# what an H100 SM holds (sm_90): registers, shared memory one block may use
SM90_REGISTERS = 65536
SM90_SHARED_BYTES = 227 * 1024
RESIDENT_PROGRAMS = 4   # what kv8.kernels.triton.attention.choose_num_kv_splits aims for


def figures(cases: list[tuple[str, str]] | None = None, stores: tuple[str, ...] = ("fp8_e4m3", "bfloat16", "int8"),
            query_dtype: str = "bfloat16") -> dict[str, dict[str, Any]]:
    """The compiled figures of the engine's launches at Llama-3.1-8B shapes (keys ``"<phase>-<kv>"``,
    ``"store-<kv>"``): by default decode and prefill attention over fp8_e4m3 and bf16 caches, decode over an int8
    cache, and the store kernel for those three; ``cases`` ((phase, kv) pairs) and ``stores`` (kv) choose
    others, ``query_dtype`` the attention's queries."""
    rows: dict[str, dict[str, Any]] = {}
    if cases is None:
        cases = [(phase, kv) for phase in ("decode", "prefill") for kv in ("fp8_e4m3", "bfloat16")]
        cases.append(("decode", "int8"))
    for phase, kv in cases:
        launch = attention_launch(kv, phase, query_dtype)
        rows[f"{phase}-{kv}"] = {"grid": list(launch.grid), **{k: launch.kwargs[k] for k in (
            "BLOCK_M", "TILE_N", "NUM_SPLITS")}, **asdict(attention_figures(launch))}
    for kv in stores:
        launch = llama_store_launch(kv)
        fig = measure(compile_launch(launch), int(launch.kwargs["num_warps"]), 1, 1)
        rows[f"store-{kv}"] = {"registers": fig.registers, "spill_bytes": fig.spill_bytes,
                               "shared_bytes": fig.shared_bytes, "num_warps": fig.num_warps}
    return rows


def violations(rows: dict[str, dict[str, Any]]) -> list[str]:
    """What the compiled kernels promise (issue 39), as the list of promises ``rows`` (:func:`figures`) break:

    * no kernel spills registers;
    * every attention loop is pipelined: a ``cp.async.wait_group`` count above 0;
    * over FP8 codes the key loops convert natively in pairs (``cvt.rn.f16x2.e4m3x2``), with no scalar FP8
      conversion and no scalar ``F2F`` in either loop;
    * the FP8 decode loop costs at most the bf16 loop's SASS instructions per KB of cache (issue 39's promise: an FP8
      KB holds twice the keys of a bf16 KB, so this is half the bf16 loop's instructions per key);
    * a decode program leaves room for :data:`RESIDENT_PROGRAMS` per SM (registers and shared memory).

    The int8 decode (``decode-int8``: dynamic scales, bf16 operands) keeps the promises that are not about FP8.
    """
    bad = []
    for name, r in rows.items():
        if r["spill_bytes"]:
            bad.append(f"{name}: {r['spill_bytes']} bytes of register spills")
        if name.startswith("store-"):
            continue
        if not r["wait_groups"] or max(r["wait_groups"]) == 0:
            bad.append(f"{name}: not pipelined (cp.async.wait_group counts {r['wait_groups']} in the key loop)")
        if "fp8" in name:
            if "cvt.rn.f16x2.e4m3x2" not in r["cvt_fp8_packed"] or r["cvt_fp8_scalar"]:
                bad.append(f"{name}: FP8 conversions {r['cvt_fp8_packed'] + r['cvt_fp8_scalar']}, want only "
                           "cvt.rn.f16x2.e4m3x2")
            if r["loop_f2f"] or r.get("edge_loop_f2f"):
                bad.append(f"{name}: {r['loop_f2f']} scalar F2F conversions per iteration"
                           + (f" ({r['edge_loop_f2f']} in the edge loop)" if r.get("edge_loop_f2f") else ""))
        if name.startswith("decode-"):
            regs = r["registers"] * 32 * r["num_warps"]
            if RESIDENT_PROGRAMS * regs > SM90_REGISTERS or RESIDENT_PROGRAMS * r["shared_bytes"] > SM90_SHARED_BYTES:
                bad.append(f"{name}: {regs} registers and {r['shared_bytes']} bytes of shared memory per program "
                           f"leave no room for {RESIDENT_PROGRAMS} programs per SM")
    fp8, bf16 = rows["decode-fp8_e4m3"]["instr_per_kb"], rows["decode-bfloat16"]["instr_per_kb"]
    if not fp8 <= bf16:
        bad.append(f"decode: FP8 loop {fp8} instructions per KB > bf16's {bf16}")
    return bad


def table(rows: dict[str, dict[str, Any]]) -> str:
    """The figures as a text table (the compile test prints it)."""
    cols = ("registers", "spill_bytes", "shared_bytes", "num_warps", "num_stages", "TILE_N", "NUM_SPLITS",
            "wait_groups", "async_copy_bytes", "loop_sass", "loop_f2f", "loop_f2fp", "loop_mma", "edge_loop_sass",
            "instr_per_kb")
    lines = ["kernel".ljust(18) + " ".join(c.rjust(12) for c in cols)]
    for name, r in rows.items():
        lines.append(name.ljust(18) + " ".join(str(r.get(c, "-")).replace(" ", "").rjust(12) for c in cols))
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """``python -m tests.helpers.sm90 [KV]``: the default figures, or with a cache dtype ``KV`` (e.g. fp4_e2m1)
    its decode and prefill attention and its store; ``python -m tests.helpers.sm90 --decode KV [KV ...]``: the
    decode attention over each (any kv of :func:`llama_attention_launches`); ``--decode-f32 KV [KV ...]`` the same
    with float32 queries."""
    if argv[:1] == ["--decode"]:
        rows = figures([("decode", kv) for kv in argv[1:]], ())
    elif argv[:1] == ["--decode-f32"]:
        rows = figures([("decode", kv) for kv in argv[1:]], (), query_dtype="float32")
    else:
        rows = figures() if not argv else figures([("decode", argv[0]), ("prefill", argv[0])], (argv[0],))
    print(table(rows))
    print(json.dumps(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
