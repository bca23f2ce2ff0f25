"""kv8.kernels.cpu.build: the build cache covers the headers a source includes (nested ones too), so editing one
rebuilds the library. Skipped where there is no C++ compiler."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from kv8 import envs
from kv8.kernels.cpu.build import KernelUnavailable, build_shared_library

pytestmark = pytest.mark.skipif(shutil.which(envs.cxx()) is None, reason=f"no C++ compiler ({envs.cxx()!r})")


def write_sources(tmp: Path, value: int) -> Path:
    (tmp / "inc").mkdir(exist_ok=True)
    (tmp / "inc" / "value.h").write_text(f"#pragma once\nstatic const int VALUE = {value};\n")
    src = tmp / "lib.cpp"
    src.write_text('#include "inc/value.h"\nextern "C" int value(void) { return VALUE; }\n')
    return src


def test_header_edit_rebuilds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV8_CACHE_DIR", str(tmp_path / "cache"))
    src = write_sources(tmp_path, 7)
    first = build_shared_library(src, "x86-64")
    assert build_shared_library(src, "x86-64") == first  # cached
    assert ctypes.CDLL(str(first)).value() == 7
    write_sources(tmp_path, 8)  # only the header changes
    second = build_shared_library(src, "x86-64")
    assert second != first
    assert ctypes.CDLL(str(second)).value() == 8


def test_missing_header_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV8_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "lib.cpp"
    src.write_text('#include "nowhere.h"\nextern "C" int value(void) { return 1; }\n')
    with pytest.raises(KernelUnavailable, match="nowhere.h"):
        build_shared_library(src, "x86-64")


def test_nested_header_edit_rebuilds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A header included by a header (in another directory, relative to the including file) is hashed too."""
    monkeypatch.setenv("KV8_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "parts" / "deep").mkdir(parents=True)
    (tmp_path / "parts" / "outer.h").write_text('#pragma once\n#include "deep/inner.h"\n')
    src = tmp_path / "lib.cpp"
    src.write_text('#include "parts/outer.h"\nextern "C" int value(void) { return VALUE; }\n')
    (tmp_path / "parts" / "deep" / "inner.h").write_text("#pragma once\nstatic const int VALUE = 1;\n")
    first = build_shared_library(src, "x86-64")
    (tmp_path / "parts" / "deep" / "inner.h").write_text("#pragma once\nstatic const int VALUE = 2;\n")
    second = build_shared_library(src, "x86-64")
    assert second != first
    assert ctypes.CDLL(str(second)).value() == 2
