"""CPU graphs: a forward recorded once over fixed tensors and replayed without the Python around its kernels.

A small decode batch's step on the CPU spends milliseconds in Python: ~300 module calls, argument checks, ctypes
structs and tensor allocations around kernels of a few tens of microseconds each. :class:`CPUGraph` is the CPU's
counterpart of ``torch.cuda.CUDAGraph`` for such a forward. :meth:`CPUGraph.capture` runs the forward once, eagerly,
and records what it computes, in order:

* each call of a kv8 kernel library (:meth:`kv8.kernels.cpu.abi.NativeLibrary.invoke`): the entry point and its
  argument structs, whose pointers name the tensors of this run;
* each torch operator, seen through a ``TorchDispatchMode``: one whose outputs are new memory is replayed and its
  result copied into the tensors it returned at capture; one that writes its arguments (in place, ``out=``) is
  replayed as it is; one whose outputs share the memory of its inputs (views, and ``reshape`` or ``to`` where they
  returned their input) and ``empty`` allocations are not replayed (the tensors they returned stay alive, so
  their memory is the same at every replay). Whether an operator copied is read from the run, not its schema:
  ``reshape`` may copy or not.

:meth:`CPUGraph.replay` runs the recording again: the same kernels on the same memory, the inputs being whatever the
caller wrote into the tensors the forward read (static buffers). Every tensor of the capture is kept alive by the
graph. Each run of consecutive kernel calls (a decoder stack's ~270 between a few torch operators at the start) is
replayed from C in one call, ``kv8_run_calls`` (:attr:`kv8.kernels.cpu.abi.NativeLibrary.run_calls`), over an array
of :class:`~kv8.kernels.cpu.abi.KernelCall` built at the end of capture: no Python, no ctypes argument conversion
and no GIL hand-over between the kernels of a run (a call from Python costs several microseconds, as much as a
small kernel, and the OpenMP workers wait through it). The run stops at the first call that fails and raises the
``ValueError`` that call raises eagerly (its library's message, its own description); the calls before it are made,
the ones after it are not, as in an eager forward.

Invariants: a replay computes what an eager forward over the same inputs computes, bit for bit, because it makes
the same kernel calls with the same arguments and the same torch operators in the same order. This holds only for a
forward whose work does not depend on the *values* it computes, so capture refuses (:class:`CaptureRefused`) an
operator that hands a value back to Python (``item()``, ``equal``, ``is_nonzero``, anything not returning tensors),
one whose output shape depends on values (``nonzero``, ``masked_select``, ``unique``), random ones and collectives.
Python side effects that go through neither kernels nor torch operators (an observer's hooks) are not recorded: the
caller does not capture such forwards. The thread count is read at replay: each recorded kernel struct with a
``num_threads`` field gets the count torch uses then (kv8's kernels compute the same bits on any count that does
not change their split, ``plan_threads``, which is recorded as captured).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from kv8.kernels.cpu.abi import NativeLibrary

__all__ = ["CPUGraph", "CaptureRefused", "recording"]

T = TypeVar("T")

# operators whose result Python reads, or whose output shape or values a replay could not reproduce
_REFUSED = frozenset({
    "_local_scalar_dense", "item", "equal", "is_nonzero", "is_same_size", "nonzero", "nonzero_static",
    "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "repeat_interleave",
    "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
    "normal", "normal_", "uniform_", "exponential_", "multinomial", "dropout", "native_dropout",
})
# operators that take a boolean mask as an index (the result's shape or what is written depends on values)
_MASK_INDEXED = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
# allocations whose contents nothing reads before a recorded operator or kernel writes them
_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})

_NATIVE, _FUNCTIONAL, _MUTATING, _RUN = 0, 1, 2, 3

#: the graph being captured, or None (one capture at a time)
recording: CPUGraph | None = None


class CaptureRefused(RuntimeError):
    """The forward does something a replay could not repeat (the message names it); run it eagerly."""


class CPUGraph:
    """One recorded forward (see the module docstring). ``capture`` once, then ``replay`` any number of times."""

    def __init__(self) -> None:
        self._entries: list[tuple[int, Any, tuple, Any, Any]] = []   # as recorded, one per kernel call or operator
        self._program: list[tuple[int, Any, tuple, Any, Any]] = []   # what replay runs: kernel calls in runs
        self._keep: list[Any] = []                    # every tensor and struct the entries point into
        self._thread_structs: list[ctypes.Structure] = []
        self._threads = 0
        self.captured = False
        self.owner = 0   # the capturing thread (other threads' kernel calls are not this forward's)

    def capture(self, forward: Callable[[], T]) -> T:
        """Run ``forward()`` once, recording it, and return its result (whose tensors later replays overwrite).
        Raises :class:`CaptureRefused` (and records nothing) when the forward cannot be replayed."""
        global recording
        if recording is not None:
            raise RuntimeError("a CPU graph is already being captured")
        if self.captured:
            raise RuntimeError("this CPU graph was captured already")
        recording = self
        self.owner = threading.get_ident()
        try:
            with _Recorder(self):
                result = forward()
        except CaptureRefused:
            self._entries, self._keep, self._thread_structs = [], [], []
            raise
        finally:
            recording = None
        self._threads = torch.get_num_threads()
        self._keep.append(result)
        self._program = _with_native_runs(self._entries)
        self.captured = True
        return result

    def record_native(self, lib: NativeLibrary, fn: Any, structs: tuple[ctypes.Structure, ...], what: str) -> None:
        """A kernel call made during capture (from :meth:`NativeLibrary.invoke`: ``fn(byref(s) for s in structs)``,
        described by ``what``); ignored from another thread. Refused (:class:`CaptureRefused`) with more argument
        structs than a :class:`~kv8.kernels.cpu.abi.KernelCall` holds."""
        if threading.get_ident() != self.owner:
            return
        if not 1 <= len(structs) <= lib.CALL_MAX_ARGS:
            raise CaptureRefused(f"the forward calls a kernel with {len(structs)} argument structs ({what}); a "
                                 f"replayed call takes 1 to {lib.CALL_MAX_ARGS}")
        self._entries.append((_NATIVE, fn, structs, lib, what))
        self._keep.extend(structs)
        self._thread_structs.extend(s for s in structs if any(f[0] == "num_threads" for f in s._fields_))

    def _record_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        name = func._schema.name.split("::")[-1]   # the operator, without its overload ("item" of aten.item.default)
        if name in _REFUSED or func.namespace not in ("aten", "prims"):
            raise CaptureRefused(f"the forward calls {func} (its result depends on values, is random or talks to "
                                 "other processes)")
        if name in _MASK_INDEXED and any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1:])):
            raise CaptureRefused(f"the forward indexes with a mask ({func}): its shape depends on values")
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise CaptureRefused(f"the forward reads a value back from {func}")
        self._keep.extend(outs)
        if func._schema.is_mutable:
            self._entries.append((_MUTATING, func, args, kwargs, None))   # (the entry keeps its arguments alive)
            return
        if name in _ALLOCATIONS:
            return
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        if all(o.untyped_storage().data_ptr() in inputs for o in outs):
            return   # a view (or an operator such as reshape or to that returned its input): it aliases live tensors
        self._entries.append((_FUNCTIONAL, func, args, kwargs, outs))

    def replay(self) -> None:
        """Run the recording again (see the module docstring). A kernel's error raises ``ValueError`` as the eager
        call would."""
        if not self.captured:
            raise RuntimeError("replay of a CPU graph that was not captured")
        threads = torch.get_num_threads()
        if threads != self._threads:
            for s in self._thread_structs:
                s.num_threads = threads
            self._threads = threads
        for kind, fn, args, extra, outs in self._program:
            if kind == _RUN:
                fn.replay()
            elif kind == _FUNCTIONAL:
                result = fn(*args, **extra)
                for dst, src in zip(outs, result if isinstance(result, (tuple, list)) else (result,)):
                    if dst.shape != src.shape:
                        raise RuntimeError(f"CPU graph replay: {fn} returned {list(src.shape)}, captured "
                                           f"{list(dst.shape)}")
                    dst.copy_(src)
            else:
                fn(*args, **extra)

    @property
    def num_kernel_calls(self) -> int:
        """Recorded calls of kv8's kernel libraries."""
        return sum(1 for e in self._entries if e[0] == _NATIVE)

    @property
    def num_torch_ops(self) -> int:
        """Recorded torch operators that a replay runs."""
        return len(self._entries) - self.num_kernel_calls

    @property
    def native_runs(self) -> list[int]:
        """The number of kernel calls in each run that a replay makes from C, in order (torch operators between
        them)."""
        return [e[1].count for e in self._program if e[0] == _RUN]


def _with_native_runs(entries: list[tuple[int, Any, tuple, Any, Any]]) -> list[tuple[int, Any, tuple, Any, Any]]:
    """``entries`` with each run of consecutive kernel calls replaced by one
    :class:`~kv8.kernels.cpu.abi.KernelCallRun` (through the first call's library: any one runs calls of both)."""
    program: list[tuple[int, Any, tuple, Any, Any]] = []
    run: list[tuple[NativeLibrary, Any, tuple[ctypes.Structure, ...], str]] = []
    for entry in entries + [(_FUNCTIONAL, None, (), None, None)]:   # (a sentinel that ends the last run)
        if entry[0] == _NATIVE:
            _, fn, structs, lib, what = entry
            run.append((lib, fn, structs, what))
            continue
        if run:
            program.append((_RUN, run[0][0].call_run(run), (), None, None))
            run = []
        if entry[1] is not None:
            program.append(entry)
    return program


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for x in tree for t in _tensors(x)]
    if isinstance(tree, dict):
        return [t for x in tree.values() for t in _tensors(x)]
    return []


class _Recorder(TorchDispatchMode):
    """Records every torch operator of a capture in its graph (after running it)."""

    def __init__(self, graph: CPUGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.graph._record_op(func, args, kwargs, out)
        return out
