"""scripts/setup.sh's order of steps and its channels, run against a stand-in ``.venv/bin/python`` that installs
nothing: it records what pip was asked for and what Python code ran, and behaves as an interpreter would where the
order matters (``import torch`` fails before torch is installed, and warns "Failed to initialize NumPy" before numpy
is, as torch does; torch's version is the build pip was asked for, or ``FAKE_TORCH_BUILD``'s). The real installs
are the project's quick start's business; here, the script never imports torch before kv8's dependencies (numpy
among them) are in (issue 42, item 6), and each channel installs its one torch/Triton pair (issue 39, item 6)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.helpers.paths import ROOT

FAKE_PYTHON = r"""#!/usr/bin/env bash
# A stand-in interpreter: pip installs leave markers; code that imports torch needs torch, and warns without numpy.
state="$(cd "$(dirname "$0")/../.." && pwd)/state"
mkdir -p "$state"
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
    echo "pip ${*:3}" >> "$state/log"
    case " $* " in
        *" torch==="*) echo "${FAKE_TORCH_BUILD:-2.13.0}" > "$state/torch";;      # PyPI's CUDA build
        *" torch=="*) echo "${FAKE_TORCH_BUILD:-2.13.0+cpu}" > "$state/torch";;
    esac
    case " $* " in *" -e "*|*" numpy"*) touch "$state/numpy";; esac
    exit 0
fi
if [ "$1" = "-c" ]; then code="$2"; elif [ "$1" = "-" ]; then code="$(cat)"; else echo "unexpected: $*" >&2; exit 3; fi
if printf '%s' "$code" | grep -qE "import torch|from torch|version\('torch'\)"; then
    if [ ! -e "$state/torch" ]; then echo "No module named 'torch'" >&2; exit 1; fi
    if printf '%s' "$code" | grep -q "print(m.version('torch'))"; then cat "$state/torch"; exit 0; fi
    if printf '%s\n' "$code" | grep -qE "(^|[;[:space:]])(import torch|from torch)"; then
        [ -e "$state/numpy" ] || echo "UserWarning: Failed to initialize NumPy: No module named 'numpy'" >&2
        echo "import torch" >> "$state/log"
    fi
fi
exit 0
"""


def _run_setup(tmp_path: Path, *args: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copytree(ROOT / "scripts" / "constraints", tmp_path / "scripts" / "constraints", dirs_exist_ok=True)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("KV8_TORCH_INDEX", "KV8_DEVICE", "FAKE_TORCH_BUILD")}
    return subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh"), *args], capture_output=True, text=True,
                          env={**env, **env_vars}, timeout=60)


def _pip_lines(tmp_path: Path) -> list[str]:
    return [line for line in (tmp_path / "state" / "log").read_text().splitlines() if line.startswith("pip ")]


def test_setup_imports_torch_only_once_numpy_is_installed(tmp_path: Path) -> None:
    """A fresh venv, then a second run over it: no NumPy warning in either; torch is imported (its version printed,
    the kernels built), each time after the install of kv8 and its dependencies."""
    for _ in range(2):
        run = _run_setup(tmp_path)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "NumPy" not in run.stdout + run.stderr, run.stdout + run.stderr
    log = (tmp_path / "state" / "log").read_text().splitlines()
    first_run = log[:log.index("import torch") + 1]
    assert any(line.startswith("pip ") and "torch==2.13.0" in line and " -c " not in line for line in first_run)
    assert any(line.startswith("pip ") and " -e .[test,ray]" in line for line in first_run), log
    assert log.count("import torch") == 4, log   # the version line and the kernel build, in each run


def test_the_cpu_channel_installs_its_pair(tmp_path: Path) -> None:
    run = _run_setup(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    torch_line, kv8_line = _pip_lines(tmp_path)[:2]
    assert "torch==2.13.0" in torch_line and "--index-url https://download.pytorch.org/whl/cpu" in torch_line
    assert "-c scripts/constraints/cpu.txt -e .[test,ray]" in kv8_line
    assert "setup: torch 2.13.0 already installed" in _run_setup(tmp_path).stdout   # the second run keeps it


@pytest.mark.parametrize("how", [("--cuda",), ("KV8_DEVICE=cuda",)])
def test_the_cuda_channel_installs_pypis_cuda_build_and_its_triton(tmp_path: Path, how: tuple[str, ...]) -> None:
    """``--cuda`` (or ``KV8_DEVICE=cuda``): the exact version of PyPI's CUDA build with the channel's pair, no CPU
    index; kept on the next run."""
    env = dict(a.split("=", 1) for a in how if "=" in a)
    args = [a for a in how if "=" not in a]
    run = _run_setup(tmp_path, *args, **env)
    assert run.returncode == 0, run.stdout + run.stderr
    torch_line, kv8_line = _pip_lines(tmp_path)[:2]
    assert "-c scripts/constraints/cuda.txt" in torch_line and "torch===2.13.0" in torch_line
    assert "--index-url" not in torch_line
    assert "-c scripts/constraints/cuda.txt -e .[test,ray]" in kv8_line
    assert "already installed" in _run_setup(tmp_path, *args, **env).stdout


def test_the_cuda_channel_refuses_a_cpu_build(tmp_path: Path) -> None:
    assert _run_setup(tmp_path).returncode == 0   # a CPU venv
    run = _run_setup(tmp_path, "--cuda", FAKE_TORCH_BUILD="2.13.0+cpu")   # an index that gives the CPU build
    assert run.returncode == 1
    assert "setup: --cuda wants torch 2.13.0's CUDA build, but torch 2.13.0+cpu is installed" in run.stderr


@pytest.mark.parametrize("args,env,message", [
    (("--gpu",), {}, "setup: unknown argument '--gpu'; use --cpu (the default) or --cuda"),
    ((), {"KV8_DEVICE": "tpu"}, "setup: KV8_DEVICE='tpu' is not a channel; use cpu or cuda"),
])
def test_bad_channels_are_refused(tmp_path: Path, args: tuple[str, ...], env: dict[str, str], message: str) -> None:
    run = _run_setup(tmp_path, *args, **env)
    assert run.returncode == 2 and message in run.stderr


def _pins(name: str) -> dict[str, str]:
    text = (ROOT / "scripts" / "constraints" / name).read_text()
    return {m.group(1): m.group(2) for m in re.finditer(r"^(torch|triton)={2,3}(\S+)$", text, re.M)}


def test_each_channel_pins_one_pair_inside_kv8s_bounds() -> None:
    """One torch and one Triton per constraints file, each allowed by pyproject.toml (torch by the dependency,
    Triton by the test extra, whose ends are the CPU channel's and the newest-Triton run's)."""
    text = (ROOT / "pyproject.toml").read_text()
    torch_req, triton_req = (Requirement(re.findall(rf'"({name}[<>=!~][^"]*)"', text)[0])
                             for name in ("torch", "triton"))
    pairs = {name: _pins(name) for name in ("cpu.txt", "cuda.txt", "triton-newest.txt")}
    assert pairs == {"cpu.txt": {"torch": "2.13.0", "triton": "3.6.0"},
                     "cuda.txt": {"torch": "2.13.0", "triton": "3.7.1"},
                     "triton-newest.txt": {"torch": "2.13.0", "triton": "3.9.0"}}
    for pair in pairs.values():
        assert torch_req.specifier.contains(pair["torch"]) and triton_req.specifier.contains(pair["triton"])
    assert not triton_req.specifier.contains("3.5.0") and not triton_req.specifier.contains("3.10.0")
