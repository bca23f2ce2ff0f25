"""The checks options and inputs share, each written once: integers, numbers, booleans, choices, memory sizes.

Every check raises ``ValueError`` naming the field (as the user wrote it: ``max_num_seqs``, ``--max-n``,
``logit_bias``), the value, and what is allowed; callers run each check once, where the value enters kv8
(:mod:`kv8.options` for declared options, the configs' ``__post_init__``, request validation). ``bool`` is never
an int here (Python's ``True == 1`` would otherwise let ``max_num_seqs=True`` through).

Also the one reader of how much memory this process may still take (:func:`memory_available`: ``MemAvailable``
lowered to what a cgroup v2 limit leaves), which both the default KV budget and the cache-fits check use.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Collection, Mapping
from typing import Any

__all__ = ["check_bool", "check_choice", "check_int", "check_number", "format_bytes", "is_int", "is_number",
           "memory_available", "parse_memory"]


def is_int(value: Any) -> bool:
    """An integer (``int``, or an integral type such as numpy's) that is not a ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A real number (``int``, ``float``, numpy's) that is not a ``bool``."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _bounds(minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    return f" <= {maximum}" if maximum is not None else ""


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None, *,
              optional: bool = False) -> None:
    """``value`` is an int (not a bool) within the bounds given (None too, with ``optional``)."""
    if optional and value is None:
        return
    if not is_int(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name}={value!r} must be an int{_bounds(minimum, maximum)}"
                         + (" (or None)" if optional else ""))


def check_number(name: str, value: Any, minimum: float | None = None, maximum: float | None = None, *,
                 exclusive_minimum: bool = False) -> None:
    """``value`` is a finite int or float (not a bool) within the bounds given (``> minimum`` with
    ``exclusive_minimum``)."""
    ok = is_number(value) and math.isfinite(value)
    if ok and minimum is not None:
        ok = value > minimum if exclusive_minimum else value >= minimum
    if ok and maximum is not None:
        ok = value <= maximum
    if not ok:
        if exclusive_minimum:
            bound = f" in ({minimum}, {maximum}]" if maximum is not None else f" > {minimum}"
        else:
            bound = _bounds(minimum, maximum)
        raise ValueError(f"{name}={value!r} must be a finite number{bound}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")


def check_choice(name: str, value: Any, choices: Collection[Any], *, optional: bool = False, hint: str = "") -> None:
    """``value`` is one of ``choices`` (or None, with ``optional``); ``hint`` ends the message (what else to do)."""
    if optional and value is None:
        return
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of: {', '.join(map(str, choices))}"
                         + (f" {hint}" if hint else ""))


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "tb": 1000**4}


def parse_memory(value: int | str, name: str = "kv_cache_memory") -> int:
    """Bytes from an int or a string such as ``"2GiB"``, ``"512MiB"``, ``"1.5GB"`` or ``"1000000"``; > 0."""
    if is_int(value):
        nbytes = int(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a memory size; use bytes (an int) or a number with one of the units "
                f"{', '.join(u for u in _UNITS if u)} (e.g. '2GiB')")
        nbytes = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"{name}={value!r} must be an int (bytes) or a string such as '2GiB'")
    if nbytes <= 0:
        raise ValueError(f"{name}={value!r} must be positive")
    return nbytes


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit below 1,024 of it (``"2.00 GiB"``; whole bytes under 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def memory_available(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Bytes of memory this process may still take: ``MemAvailable``, lowered to what the cgroup v2 memory limit
    leaves (``memory.max - memory.current``; a container's limit is often below the host's free memory); None
    where neither can be read."""
    found: list[int] = []
    try:
        with open(meminfo) as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"{cgroup}/memory.max") as f:
            limit = f.read().strip()
        with open(f"{cgroup}/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def cfg_int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """``cfg[key]`` as an int (a JSON null takes ``default``); ``ValueError`` naming the key otherwise."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"model config is missing the key {key!r}")
        return default
    if not is_int(value):
        raise ValueError(f"model config {key}={value!r} must be an integer")
    return value


def cfg_float(cfg: Mapping[str, Any], key: str, default: float) -> float:
    value = cfg.get(key)
    if value is None:
        return default
    if not is_number(value):
        raise ValueError(f"model config {key}={value!r} must be a number")
    return float(value)
