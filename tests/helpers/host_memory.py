"""What the host's kernel grants: its transparent-huge-page mode."""

from __future__ import annotations

import re


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (always / madvise / never), None where it has none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            found = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return found.group(1) if found else None
