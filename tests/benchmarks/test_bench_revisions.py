"""``benchmarks/revisions.py``: the older kv8 tree that ``bench_vs_peers --kv8-before`` and ``bench_linear
--before`` measure beside the current one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import revisions  # noqa: E402


def test_worktree_checks_out_the_revision_and_removes_it() -> None:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    with revisions.worktree("HEAD") as checkout:
        tree = checkout.path
        assert head.startswith(checkout.rev) and len(checkout.rev) >= 7
        assert (Path(tree) / "kv8" / "kernels" / "cpu" / "csrc" / "dense" / "dense.cpp").is_file()
        got = subprocess.run(["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        assert got == head
    assert not os.path.exists(tree) and not os.path.exists(os.path.dirname(tree))
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True,
                            check=True).stdout
    assert tree not in listed


def test_an_unknown_revision_is_refused_naming_the_option() -> None:
    with pytest.raises(ValueError, match=r"--before: 'no-such-revision-xyz' is not a commit"):
        with revisions.worktree("no-such-revision-xyz", "--before"):
            pass
    assert len(revisions.short_rev("HEAD")) >= 7
