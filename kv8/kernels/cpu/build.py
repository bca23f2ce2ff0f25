"""Build a C++ source of kv8 into a shared library once, and cache it.

Sources are plain C++ with a C ABI (intrinsics, OpenMP, no torch headers), loaded with ctypes. They are
compiled with the system compiler (``$CXX``, default ``g++``) as ``-O3 -fopenmp -shared -fPIC -std=c++17
-march=<march>`` and cached as ``<cache dir>/kernels/<hash>.so``; the hash covers the source, the compiler
command, the compiler version and the CPU flags, so an edited source, another compiler or another CPU gets its
own build; it also covers the files the source includes with ``#include "..."`` (kv8's shared headers, found
relative to the including file, as the compiler finds them), so editing a header rebuilds every library that
uses it. The cache dir is ``$KV8_CACHE_DIR`` if set, else ``~/.cache/kv8``. Each build goes to a private
temporary file and is published with an atomic ``os.replace``, so concurrent first starts are safe (both may
compile; either result is complete).

Compiling takes about a minute, so the first build in a process says so once on stderr (the cached libraries of
later starts load silently).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kv8 import envs

__all__ = ["BASE_FLAGS", "KernelUnavailable", "build_shared_library", "cpu_flags"]

BASE_FLAGS: tuple[str, ...] = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


class KernelUnavailable(RuntimeError):
    """The C++ kernels could not be built or loaded (the message says why)."""


def _cache_dir() -> Path:
    return Path(envs.cache_dir()) / "kernels"


def cpu_flags() -> str:
    """The ``flags`` line of /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def _source_texts(source: Path) -> list[bytes]:
    """The bytes of ``source`` and, recursively, of the files it includes with ``#include "..."`` (each once,
    in a fixed order); raises OSError when one cannot be read."""
    seen: set[Path] = set()
    texts: list[bytes] = []
    stack = [source.resolve()]
    while stack:
        path = stack.pop()
        if path in seen:
            continue
        seen.add(path)
        text = path.read_bytes()
        texts.append(text)
        stack.extend((path.parent / name.decode()).resolve() for name in reversed(_LOCAL_INCLUDE.findall(text)))
    return texts


_announced = False


def _announce_compiling() -> None:
    """Say once per process that kernels are being compiled (a minute of silence otherwise looks like a hang)."""
    global _announced
    if not _announced:
        _announced = True
        print("kv8: compiling kv8's CPU kernels (first use, about a minute; cached for later runs)...",
              file=sys.stderr, flush=True)


def _compiler() -> str:
    cxx = envs.cxx()
    path = shutil.which(cxx)
    if path is None:
        raise KernelUnavailable(f"no C++ compiler: {cxx!r} is not on PATH (set CXX to a g++-compatible compiler)")
    return path


def build_shared_library(source: Path, march: str) -> Path:
    """Compile (or find the cached) shared library of ``source`` for ``-march=march``; returns its path.
    Raises :class:`KernelUnavailable` with the reason when it cannot."""
    cxx = _compiler()
    flags = (*BASE_FLAGS, f"-march={march}")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"cannot run the compiler {cxx}: {exc}") from exc
    digest = hashlib.sha256()
    try:
        texts = _source_texts(source)
    except OSError as exc:
        raise KernelUnavailable(f"cannot read {source.name} or a file it includes: {exc}") from exc
    for part in (*texts, " ".join(flags).encode(), version.encode(), cpu_flags().encode()):
        digest.update(part)
        digest.update(b"\0")
    out_dir = _cache_dir()
    target = out_dir / f"{digest.hexdigest()[:24]}.so"
    if target.exists():
        return target
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
        os.close(fd)
    except OSError as exc:
        raise KernelUnavailable(f"cannot write the kernel cache directory {out_dir}: {exc}") from exc
    _announce_compiling()
    try:
        cmd = [cxx, *flags, "-o", tmp, str(source)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise KernelUnavailable(f"compiling {source.name} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)  # atomic: a concurrent loader sees no file or a complete one
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"compiling {source.name} failed: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
