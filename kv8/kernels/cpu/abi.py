"""The C boundary both kernel libraries share (``csrc/common/kv8_abi.h``), from the Python side.

Each library's entry points take pointers to argument structs that Python mirrors with ``ctypes.Structure``
classes. The library exports the layout of its structs as a text (``kv8_abi_layout()``: each struct's size and each
field's offset and size), and :class:`NativeLibrary` compares it at load with the same text built from the mirror
(:func:`abi_layout`), so a struct edited on one side only is :class:`KernelUnavailable`, never a misread argument.
The library's error codes come with its messages (``kv8_error_message``), raised as ``ValueError``; its code
tables (``kv8_*_name``) are read with :func:`code_table`. No number of the C side is copied here.

Both libraries also share one struct, :class:`KernelCall` (first in every layout text, :data:`COMMON_STRUCTS`), and one
entry point, ``kv8_run_calls`` (:attr:`NativeLibrary.run_calls`): an array of recorded calls made in order from C,
stopping at the first failure, which :class:`kv8.kernels.cpu.graph.CPUGraph` replays its runs of kernel calls with.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from kv8.kernels.cpu import graph
from kv8.kernels.cpu.build import KernelUnavailable

__all__ = ["COMMON_STRUCTS", "KERNEL_CALL_MAX_ARGS", "KernelCall", "KernelCallRun", "NativeLibrary", "RecordedCall",
           "Structs", "abi_layout", "check_abi", "code_table"]

#: (C struct name, its ctypes mirror) for each argument struct of a library, in the order of its layout text.
Structs = tuple[tuple[str, type[ctypes.Structure]], ...]

#: the most argument structs one recorded call passes (the C side's KV8_CALL_MAX_ARGS: :class:`KernelCall`'s ``arg``
#: fields, whose layout is checked)
KERNEL_CALL_MAX_ARGS = 4


class KernelCall(ctypes.Structure):
    """``kv8_kernel_call``: one recorded call, ``fn(arg0, ..., arg<nargs - 1>)`` (pointers to argument structs)."""

    _fields_ = [("fn", ctypes.c_void_p), ("nargs", ctypes.c_int64), ("arg0", ctypes.c_void_p),
                ("arg1", ctypes.c_void_p), ("arg2", ctypes.c_void_p), ("arg3", ctypes.c_void_p)]


#: the structs every library's layout text starts with (csrc/common/kv8_abi.h's KV8_COMMON_STRUCTS)
COMMON_STRUCTS: Structs = (("kv8_kernel_call", KernelCall),)

#: a kernel call as a CPU graph records it: (its library, the entry point, its argument structs, its description)
RecordedCall = tuple["NativeLibrary", Any, tuple[ctypes.Structure, ...], str]


def abi_layout(structs: Structs) -> str:
    """The layout text of ``structs`` in the format of the C side's ``kv8_abi_layout()``."""
    parts = []
    for name, struct in structs:
        fields = " ".join(f"{f[0]}@{getattr(struct, f[0]).offset}+{getattr(struct, f[0]).size}"
                          for f in struct._fields_)
        parts.append(f"{name} {ctypes.sizeof(struct)}: {fields};")
    return " ".join(parts)


def check_abi(c_layout: str, structs: Structs, mirror: str) -> None:
    """Raise :class:`KernelUnavailable` unless the library's struct layout equals that of its ctypes mirror
    (:data:`COMMON_STRUCTS`, then ``structs``, defined in the module ``mirror``)."""
    mine = abi_layout(COMMON_STRUCTS + structs)
    if c_layout != mine:
        raise KernelUnavailable(f"the kernel library's argument structs differ from their ctypes mirror in {mirror} "
                                f"(edit both together):\n  C:      {c_layout}\n  Python: {mine}")


def code_table(fn: Any) -> dict[str, int]:
    """{name: code} of a ``kv8_*_name(int)`` table function (NULL ends the table)."""
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_char_p
    table, code = {}, 0
    while (name := fn(code)) is not None:
        table[name.decode()] = code
        code += 1
    return table


class NativeLibrary:
    """A kernel library loaded with ctypes, its argument structs (:attr:`STRUCTS`, set by each subclass) checked
    against the library's layout; raises :class:`KernelUnavailable` when it cannot be loaded or does not match."""

    STRUCTS: ClassVar[Structs]
    CALL_MAX_ARGS: ClassVar[int] = KERNEL_CALL_MAX_ARGS   # argument structs of one call a KernelCallRun replays

    def __init__(self, path: Path) -> None:
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise KernelUnavailable(f"cannot load {path}: {exc}") from exc
        self.path = path
        self._lib = lib
        self._bind("kv8_abi_layout", [], ctypes.c_char_p)
        self._bind("kv8_error_message", [ctypes.c_int], ctypes.c_char_p)
        check_abi(self.abi_layout(), self.STRUCTS, type(self).__module__)
        #: ``run_calls(calls, count, byref(code)) -> index``: ``calls`` (the address of ``count`` :class:`KernelCall`)
        #: made in order; the index of the first that failed, its return code in ``code``, or ``count``
        self.run_calls = self._bind("kv8_run_calls", [ctypes.c_void_p, ctypes.c_int64,
                                                      ctypes.POINTER(ctypes.c_int32)], ctypes.c_int64)

    def _bind(self, name: str, argtypes: list[Any], restype: Any = ctypes.c_int) -> Any:
        """The library's function ``name``, declared with ``argtypes`` and ``restype``; :class:`KernelUnavailable`
        where the library lacks it (one of another kv8 version)."""
        try:
            fn = getattr(self._lib, name)
        except AttributeError as exc:
            raise KernelUnavailable(f"{self.path} has no {name}: not a library of this kv8 version") from exc
        fn.argtypes, fn.restype = argtypes, restype
        return fn

    def _bind_structs(self, name: str, *structs: type[ctypes.Structure]) -> Any:
        """The library's entry point ``name``: pointers to ``structs`` in, an error code (0 = success) out."""
        return self._bind(name, [ctypes.POINTER(s) for s in structs])

    def abi_layout(self) -> str:
        """The library's layout text of its argument structs."""
        return self._lib.kv8_abi_layout().decode()

    def error_message(self, code: int) -> str:
        """The library's message for return code ``code``."""
        msg = self._lib.kv8_error_message(code)
        return msg.decode() if msg is not None else f"error {code}"

    def error(self, rc: int, what: str) -> ValueError:
        """The ``ValueError`` of return code ``rc`` (not 0, success): "what: the library's message"."""
        return ValueError(f"{what}: {self.error_message(rc)}")

    def call_run(self, calls: Sequence[RecordedCall]) -> KernelCallRun:
        """``calls`` (of this or the other kv8 library) replayed through this library's ``kv8_run_calls``."""
        return KernelCallRun(self.run_calls, calls)

    def invoke(self, fn: Any, what: str, *structs: ctypes.Structure) -> None:
        """Call entry point ``fn`` with pointers to ``structs``; a failure raises :meth:`error` with ``what``. A call
        made while a :class:`kv8.kernels.cpu.graph.CPUGraph` captures is recorded in it (the structs kept)."""
        rc = fn(*(ctypes.byref(s) for s in structs))
        if rc != 0:
            raise self.error(rc, what)
        if graph.recording is not None:
            graph.recording.record_native(self, fn, structs, what)


class KernelCallRun:
    """Recorded kernel calls (of any kv8 library) made in order from C by one ``kv8_run_calls``: a CPU graph's run of
    consecutive calls (:mod:`kv8.kernels.cpu.graph`).

    The array points at the entry points and at the argument structs, which the caller keeps alive; a call reads its
    structs when it is made, so a field written between replays (``num_threads``) is seen by the next one. A replay
    stops at the first call that fails and raises the ``ValueError`` it raises eagerly (:meth:`NativeLibrary.error`
    of its library and description); the calls before it were made, the ones after it are not."""

    def __init__(self, run_calls: Any, calls: Sequence[RecordedCall]) -> None:
        if not calls:
            raise ValueError("a KernelCallRun needs at least one call")
        self.count = len(calls)
        self.array = (KernelCall * self.count)()
        for c, (_, fn, structs, what) in zip(self.array, calls):
            if not 1 <= len(structs) <= KERNEL_CALL_MAX_ARGS:
                raise ValueError(f"{what}: {len(structs)} argument structs; a replayed call takes 1 to "
                                 f"{KERNEL_CALL_MAX_ARGS}")
            c.fn = ctypes.cast(fn, ctypes.c_void_p).value
            c.nargs = len(structs)
            for i, struct in enumerate(structs):
                setattr(c, f"arg{i}", ctypes.addressof(struct))
        self.sources = [(lib, what) for lib, _, _, what in calls]   # the failing call's library and description
        self._run_calls = run_calls
        self._address = ctypes.addressof(self.array)
        self._code = ctypes.c_int32(0)
        self._code_ref = ctypes.byref(self._code)

    def replay(self) -> None:
        """Make the calls in order; the first that fails raises its ``ValueError``."""
        failed = self._run_calls(self._address, self.count, self._code_ref)
        if failed != self.count:
            lib, what = self.sources[failed]
            raise lib.error(self._code.value, what)
