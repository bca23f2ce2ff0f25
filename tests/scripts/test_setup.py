"""scripts/setup.sh's order of steps, run against a stand-in ``.venv/bin/python`` that installs nothing: it records
what pip was asked for and what Python code ran, and behaves as an interpreter would where the order matters
(``import torch`` fails before torch is installed, and warns "Failed to initialize NumPy" before numpy is, as
torch does). The real installs are the project's quick start's business; here, the script never imports torch
before kv8's dependencies (numpy among them) are in (issue 42, item 6)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.helpers.paths import ROOT

FAKE_PYTHON = r"""#!/usr/bin/env bash
# A stand-in interpreter: pip installs leave markers; code that imports torch needs torch, and warns without numpy.
state="$(cd "$(dirname "$0")/../.." && pwd)/state"
mkdir -p "$state"
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
    echo "pip ${*:3}" >> "$state/log"
    case " $* " in *" torch=="*) touch "$state/torch";; esac
    case " $* " in *" -e "*|*" numpy"*) touch "$state/numpy";; esac
    exit 0
fi
if [ "$1" = "-c" ]; then code="$2"; elif [ "$1" = "-" ]; then code="$(cat)"; else echo "unexpected: $*" >&2; exit 3; fi
if printf '%s' "$code" | grep -qE "import torch|from torch|version\('torch'\)"; then
    if [ ! -e "$state/torch" ]; then echo "No module named 'torch'" >&2; exit 1; fi
    if printf '%s\n' "$code" | grep -qE "(^|[;[:space:]])(import torch|from torch)"; then
        [ -e "$state/numpy" ] || echo "UserWarning: Failed to initialize NumPy: No module named 'numpy'" >&2
        echo "import torch" >> "$state/log"
    fi
fi
exit 0
"""


def _run_setup(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "KV8_TORCH_INDEX"}
    return subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], capture_output=True, text=True,
                          env=env, timeout=60)


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
