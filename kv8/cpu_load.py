"""How much CPU time other processes take on this process's CPUs, read from ``/proc/stat``: :class:`CpuClock`.

Two readers use it: the thread governor (:mod:`kv8.engine.threads`: fewer threads while other processes keep
cores busy) and the dense-layer tuner (:mod:`kv8.layers.tuning`: a plan timed beside other work is provisional).

Invariant: :func:`others_cores` counts what the CPUs were busy with, steal time included (on a VM that is other
guests'), minus this process's own CPU time (all its threads), so it never counts the caller's own work; it is
0.0 for readings with no time between them. Where ``/proc/stat`` cannot be read, :func:`read_cpu_clock` returns
None and callers do without.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

__all__ = ["CpuClock", "others_cores", "read_cpu_clock", "this_process_cpus"]


@dataclass(frozen=True)
class CpuClock:
    """One reading: wall seconds, busy seconds summed over a set of CPUs (``/proc/stat``: user, nice, system,
    irq, softirq, steal), and this process's own CPU seconds (all its threads)."""

    wall: float
    busy: float
    own: float


def this_process_cpus() -> frozenset[int]:
    """The CPUs this process may run on."""
    return frozenset(os.sched_getaffinity(0))


def read_cpu_clock(cpus: frozenset[int], stat_path: str = "/proc/stat") -> CpuClock | None:
    """A :class:`CpuClock` for ``cpus``; None where ``stat_path`` cannot be read or lacks those CPUs."""
    hz = os.sysconf("SC_CLK_TCK")
    busy = 0
    seen = 0
    try:
        with open(stat_path) as f:
            for line in f:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *fields = line.split()
                if not name[3:].isdigit() or int(name[3:]) not in cpus:
                    continue
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
                busy += user + nice + system + irq + softirq + steal
                seen += 1
    except (OSError, ValueError):
        return None
    if seen != len(cpus):
        return None
    return CpuClock(time.monotonic(), busy / hz, time.process_time())


def others_cores(before: CpuClock, after: CpuClock) -> float:
    """Cores' worth of CPU time other processes took between two readings of the same CPUs (>= 0)."""
    wall = after.wall - before.wall
    if wall <= 0:
        return 0.0
    return max(0.0, (after.busy - before.busy) - (after.own - before.own)) / wall
