"""Paths of the repository the tests read, wherever the test module sits under tests/."""

from __future__ import annotations

from pathlib import Path

#: the repository's root (where pyproject.toml is)
ROOT = Path(__file__).resolve().parents[2]
#: recorded files the tests read (tests/fixtures, described by its README.md)
FIXTURES = ROOT / "tests" / "fixtures"
