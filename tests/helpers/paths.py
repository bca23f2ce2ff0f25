"""Paths of the repository the tests read, wherever the test module sits under tests/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

#: the repository's root (where pyproject.toml is)
ROOT = Path(__file__).resolve().parents[2]
#: recorded files the tests read (tests/fixtures, described by its README.md)
FIXTURES = ROOT / "tests" / "fixtures"


def load_file_module(path: Path) -> ModuleType:
    """The script or benchmark at ``path`` (not a package module) executed afresh as module ``path.stem``, registered
    in ``sys.modules`` under that name first: dataclasses look their module up while the file executes."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
