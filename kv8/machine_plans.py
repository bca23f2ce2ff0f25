"""This machine's plan file: choices timed once per machine and kept, ``<KV8_CACHE_DIR>/tuning/<machine>.json``.

Two tuners write it: the dense layers' (:mod:`kv8.layers.tuning`: which linear method, per model shapes) and the
attention kernels' (:mod:`kv8.attention.tuning`: how far ahead the decode kernels stream the cache). Each keeps its
entries under keys of its own (the attention's start with ``attention/``), in one file named by a digest of
:func:`machine_key`: the CPU model, its kernel-relevant ISA flags, kv8's and torch's versions and the thread
count.

Invariants: reading never raises -- a missing, corrupt or foreign file (another machine key, another
:data:`PLAN_VERSION`) reads as empty, so its choices are timed again, never read as this machine's; writing is
atomic (a temporary file renamed over the old one) and a failure is logged and ignored, so a read-only cache
directory costs a timing at every start, never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kv8 import envs
from kv8.version import __version__

logger = logging.getLogger("kv8")

__all__ = ["PLAN_VERSION", "MachinePlans", "fastest_call", "machine_key"]

# 2: with quantization="gguf", one dense plan per block type (1: every decoder layer timed in the file's most common
# type); a file of another version is ignored, so its plans are timed once again, never read as this version's
PLAN_VERSION = 2
# the ISA flags that decide which kernels a machine runs (a plan is reused only where they are the same)
_ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_vbmi",
              "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_bf16", "amx_int8", "amx_fp16")


def machine_key() -> dict[str, str]:
    """What a plan depends on besides the model: the CPU model, its kernel-relevant ISA flags, kv8's and torch's
    versions, the thread count."""
    name, flags = "", set[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": name, "isa": " ".join(f for f in _ISA_FLAGS if f in flags), "kv8": __version__,
            "torch": torch.__version__, "threads": str(torch.get_num_threads())}


def fastest_call(fn: Callable[[], Any], clock: Callable[[], float] = time.perf_counter, min_time: float = 0.02,
                 max_calls: int = 50, warm_up: bool = True) -> float:
    """The fastest of several calls of ``fn`` (after one warm-up call, unless ``warm_up`` is False): at least 2, more
    until ``min_time``."""
    if warm_up:
        fn()
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 2 or (spent < min_time and calls < max_calls):
        start = clock()
        fn()
        took = clock() - start
        best, spent, calls = min(best, took), spent + took, calls + 1
    return best


class MachinePlans:
    """The plan file of this machine: ``{"version", "machine", "plans": {key: entry}}``, each entry a JSON object
    one tuner wrote (module docstring: reading never raises, writing is atomic)."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, machine: dict[str, str] | None = None) -> None:
        self.machine = machine if machine is not None else machine_key()
        digest = hashlib.sha256(json.dumps(self.machine, sort_keys=True).encode()).hexdigest()[:16]
        self.path = Path(directory if directory is not None else Path(envs.cache_dir()) / "tuning") / f"{digest}.json"

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning("tuning plans %s unreadable (%s); timing again", self.path, exc)
            return {}
        if not isinstance(data, dict) or data.get("version") != PLAN_VERSION or data.get("machine") != self.machine \
                or not isinstance(data.get("plans"), dict):
            return {}
        return data["plans"]

    def entry(self, key: str) -> Any:
        """The entry kept under ``key``, as written (None where there is none or the file is not this machine's)."""
        return self._read().get(key)

    def keep(self, key: str, entry: dict[str, Any]) -> bool:
        """Write ``entry`` under ``key``, the file's other entries kept; False (logged) where it cannot be written."""
        plans = self._read()
        plans[key] = entry
        data = {"version": PLAN_VERSION, "machine": self.machine, "plans": plans}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".plan-")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("could not write the tuning plan %s (%s); the next run times again", self.path, exc)
            return False
        return True
