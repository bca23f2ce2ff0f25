"""The compiled AVX-512 prefill loop keeps its accumulators in registers.

The attention library's prefill loop (csrc/attention/item_prefill.h: ``prefill_block`` and ``tile_pv``, inlined into
``run_item_tile_with``) multiplies blocks of 4 query rows x 64 tokens with 16 independent ``vdpbf16ps`` chains. How
fast it runs depends on code the compiler chooses: GCC 12 once kept the Q·Kᵀ chains in registers but also stored all
16 of them to the stack after every channel pair (the array was read through a pointer after the loop), and the
stores bound the loop at 0.57x its speed with the sums in registers (docs/benchmarks.md, "Prefill attention, SmolLM2
shapes"). No result changes, so only the machine code shows it: this test disassembles the library (``objdump``) and
checks every innermost loop of those functions with 8 or more ``vdpbf16ps`` for zmm stores to the stack frame.

The library is the one this machine runs where it has the AVX-512 BF16 fast path (already built), else a build for
``-march=sapphirerapids`` (the same source and compiler; compiled once and cached), so the check runs on every x86-64
machine with ``g++`` and ``objdump``.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from dataclasses import dataclass

import pytest

from kv8.kernels.cpu.attention import SOURCE, load_kernels
from kv8.kernels.cpu.build import KernelUnavailable, build_shared_library

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or shutil.which("objdump") is None or platform.machine() not in ("x86_64", "AMD64"),
    reason="needs g++, objdump and an x86-64 machine")

JUMP = re.compile(r"j\w+\s+([0-9a-f]+)\b")
STACK_STORE = re.compile(r"vmov\w*\s+%zmm\d+,\s*-?(?:0x[0-9a-f]+)?\(%r[bs]p[),]")


@dataclass(frozen=True)
class Loop:
    function: str
    start: int
    end: int
    body: tuple[str, ...]

    def count(self, pattern: re.Pattern[str] | str) -> int:
        if isinstance(pattern, str):
            return sum(pattern in ins for ins in self.body)
        return sum(bool(pattern.match(ins)) for ins in self.body)


def innermost_loops(disassembly: str, wanted: tuple[str, ...]) -> list[Loop]:
    """The innermost loops (a backward jump whose body holds no other backward jump) of the functions whose
    demangled names contain one of ``wanted``."""
    functions: dict[str, list[tuple[int, str]]] = {}
    name = None
    for line in disassembly.splitlines():
        if line.endswith(">:"):
            name = line if any(w in line for w in wanted) else None
            if name is not None:
                functions[name] = []
            continue
        m = re.match(r"\s*([0-9a-f]+):\s*(.*)", line)
        if name is not None and m:
            functions[name].append((int(m.group(1), 16), m.group(2).strip()))
    loops = []
    for func, code in functions.items():
        back = [(a, int(m.group(1), 16)) for a, ins in code if (m := JUMP.match(ins)) and int(m.group(1), 16) < a]
        for end, start in back:
            if any(start <= a < end and t < a for a, t in back if a != end):
                continue   # holds another loop
            loops.append(Loop(func, start, end, tuple(ins for a, ins in code if start <= a <= end)))
    return loops


@pytest.fixture(scope="module")
def prefill_loops() -> list[Loop]:
    try:
        native = load_kernels()
    except KernelUnavailable:
        native = None
    if native is not None and native.has_fast_path:
        path = native.path
    else:   # the same source and compiler for a CPU that has the fast path
        path = build_shared_library(SOURCE, "sapphirerapids")
    text = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", str(path)], check=True, capture_output=True,
                          text=True).stdout
    return [lp for lp in innermost_loops(text, ("run_item_tile_with<", "tile_pv<")) if lp.count("vdpbf16ps") >= 8]


def test_the_prefill_loops_are_found(prefill_loops: list[Loop]) -> None:
    """The check below is not vacuous: the Q·Kᵀ loops of 4 tiles (16 chains, bf16 queries and with their low
    parts: 32) and the P·V loops of 4 rows x 4 accumulators are there to check."""
    counts = {lp.count("vdpbf16ps") for lp in prefill_loops}
    assert 16 in counts and 32 in counts, sorted(counts)
    assert any("tile_pv<" in lp.function for lp in prefill_loops)
    assert any("run_item_tile_with<false, false>" in lp.function for lp in prefill_loops)


def test_no_prefill_loop_stores_its_accumulators_to_the_stack(prefill_loops: list[Loop]) -> None:
    spilling = [f"{lp.function[:60]}... {lp.start:x}-{lp.end:x}: {lp.count('vdpbf16ps')} vdpbf16ps, "
                f"{lp.count(STACK_STORE)} zmm stores to the stack" for lp in prefill_loops if lp.count(STACK_STORE)]
    assert not spilling, "\n".join(spilling)


def test_the_check_sees_a_spilling_loop() -> None:
    """The loop finder and the store pattern on a hand-written listing of the loop as GCC 12 compiled it at 226f4cb
    (one of four chains shown per row), and on the same loop without the stores."""
    spilled = """0000000000001000 <int run_item_tile_with<false, false>(Problem const&)>:
    1000:  vpbroadcastd (%rcx,%rax,1),%zmm1
    1007:  vmovdqa64 (%rdx,%r10,1),%zmm3
    100e:  vdpbf16ps %zmm1,%zmm3,%zmm6
    1014:  vmovaps %zmm6,-0xbb0(%rbp)
    101e:  vdpbf16ps %zmm1,%zmm3,%zmm7
    1024:  vmovaps %zmm7,-0xb70(%rbp)
    102e:  vdpbf16ps %zmm1,%zmm3,%zmm8
    1034:  vdpbf16ps %zmm1,%zmm3,%zmm9
    103a:  vdpbf16ps %zmm1,%zmm3,%zmm10
    1040:  vdpbf16ps %zmm1,%zmm3,%zmm11
    1046:  vdpbf16ps %zmm1,%zmm3,%zmm12
    104c:  vdpbf16ps %zmm1,%zmm3,%zmm13
    1052:  vmovaps %zmm13,0x40(%rsp)
    1058:  cmp    %rdx,%rsi
    105b:  jne    1000 <int run_item_tile_with<false, false>(Problem const&)+0x0>
    1061:  ret
"""
    (loop,) = innermost_loops(spilled, ("run_item_tile_with<",))
    assert (loop.start, loop.end, loop.count("vdpbf16ps"), loop.count(STACK_STORE)) == (0x1000, 0x105B, 8, 3)
    clean = "\n".join(ln for ln in spilled.splitlines() if "vmovaps" not in ln)
    (loop,) = innermost_loops(clean, ("run_item_tile_with<",))
    assert loop.count(STACK_STORE) == 0 and loop.count("vdpbf16ps") == 8
