"""The C boundary both kernel libraries share (``csrc/common/kv8_abi.h``), from the Python side.

Each library's entry points take pointers to argument structs that Python mirrors with ``ctypes.Structure``
classes. The library exports the layout of its structs as a text (``kv8_abi_layout()``: each struct's size and each
field's offset and size), and :class:`NativeLibrary` compares it at load with the same text built from the mirror
(:func:`abi_layout`), so a struct edited on one side only is :class:`KernelUnavailable`, never a misread argument.
The library's error codes come with its messages (``kv8_error_message``), raised as ``ValueError``; its code
tables (``kv8_*_name``) are read with :func:`code_table`. No number of the C side is copied here.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, ClassVar

from kv8.kernels.cpu import graph
from kv8.kernels.cpu.build import KernelUnavailable

__all__ = ["NativeLibrary", "Structs", "abi_layout", "check_abi", "code_table"]

#: (C struct name, its ctypes mirror) for each argument struct of a library, in the order of its layout text.
Structs = tuple[tuple[str, type[ctypes.Structure]], ...]


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
    (``structs``, defined in the module ``mirror``)."""
    mine = abi_layout(structs)
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

    def invoke(self, fn: Any, what: str, *structs: ctypes.Structure) -> None:
        """Call entry point ``fn`` with pointers to ``structs``; a failure raises :meth:`error` with ``what``. A call
        made while a :class:`kv8.kernels.cpu.graph.CPUGraph` captures is recorded in it (the structs kept)."""
        pointers = tuple(ctypes.byref(s) for s in structs)
        rc = fn(*pointers)
        if rc != 0:
            raise self.error(rc, what)
        if graph.recording is not None:
            graph.recording.record_native(self, fn, structs, pointers, what)
