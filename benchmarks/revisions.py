"""kv8 as of an older git revision, for the benchmarks that measure before and after in one run.

:func:`short_rev` checks that a revision is a commit of this repository; :func:`worktree` checks it out in a
detached ``git worktree`` in a new temporary directory and removes both when its ``with`` block ends. A
benchmark imports kv8 (or builds kv8's kernels) from the tree it yields, beside the current tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def short_rev(rev: str, option: str = "--kv8-before") -> str:
    """``rev``'s abbreviated commit hash; `ValueError` naming ``option`` when git does not know it."""
    proc = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "--verify", rev + "^{commit}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise ValueError(f"{option}: {rev!r} is not a commit of {REPO}: {proc.stderr.strip()}")
    return proc.stdout.strip()


@dataclass(frozen=True)
class Checkout:
    """A temporary worktree: its ``path`` and the abbreviated hash of the commit checked out there."""

    path: str
    rev: str


@contextmanager
def worktree(rev: str, option: str = "--kv8-before") -> Iterator[Checkout]:
    """A detached worktree of ``rev`` (checked first by :func:`short_rev`), removed on exit."""
    short = short_rev(rev, option)
    tree = os.path.join(tempfile.mkdtemp(prefix="kv8-before-"), "kv8")
    proc = subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", tree, rev], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        shutil.rmtree(os.path.dirname(tree), ignore_errors=True)
        raise RuntimeError(f"git worktree add {tree} {rev} failed: {proc.stderr.strip()}")
    try:
        yield Checkout(tree, short)
    finally:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tree], capture_output=True)
        shutil.rmtree(os.path.dirname(tree), ignore_errors=True)
