"""The tests' own plumbing: what a module under tests/ may import, and where test files sit.

Test modules share code through tests/helpers/ only: no module under tests/ imports a conftest.py (pytest loads
those itself, for their fixtures and the environment they set) or a test module (a test imported into another
module is collected there again, and two files that should move freely are tied). Each directory of tests/ is a
package that mirrors the package of that name under kv8/, or tests the scripts of benchmarks/ or scripts/, or is
the helpers."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import ROOT

TESTS = ROOT / "tests"
#: directories of tests/ that mirror no package of kv8/: the tests of benchmarks/ and scripts/, the shared code
NOT_MIRRORS = {"benchmarks", "scripts", "helpers"}


def _modules() -> list[Path]:
    """Every Python module under tests/ (test modules, conftest files, helpers)."""
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _dotted(path: Path) -> str:
    """The module name of a file under the repository's root (``tests/engine/test_engine.py``: tests.engine.test_engine;
    a package's ``__init__.py``: the package)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(name: str) -> bool:
    return (ROOT.joinpath(*name.split(".")) / "__init__.py").exists()


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_init: bool) -> list[str]:
    """The modules an import statement of ``module`` loads: ``import a.b`` loads a.b; ``from a import b`` loads a,
    and a.b as well where a is a package (b may be its submodule); relative imports are resolved against
    ``module``'s package."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_init else module.split(".")[:-1]
        anchor = package[:len(package) - (node.level - 1)]
        base = ".".join([*anchor, *([base] if base else [])])
    names = [base] if base else []
    if not base or _is_package(base):
        names += [f"{base}.{alias.name}" if base else alias.name for alias in node.names if alias.name != "*"]
    return names


def _test_module_names() -> set[str]:
    """The file names (without .py) of the test modules, for imports that name one without its package (a test
    directory put on sys.path)."""
    return {p.stem for p in _modules() if p.stem.startswith("test_")}


def _forbidden(name: str, test_stems: set[str]) -> str | None:
    """Why importing ``name`` is not allowed in a module under tests/, or None."""
    parts = name.split(".")
    if parts[-1] == "conftest":
        return "a conftest (fixtures are pytest's to load; shared code goes in tests/helpers/)"
    if parts[0] == "tests" and any(part.startswith("test_") for part in parts[1:]):
        return "another test module (shared code goes in tests/helpers/)"
    if len(parts) == 1 and name in test_stems:
        return "another test module, by its bare name (shared code goes in tests/helpers/)"
    return None


def import_violations(source: str, module: str, is_init: bool = False) -> list[str]:
    """``line: imports NAME (the statement): why`` for each import in ``source`` (the module ``module``; ``is_init``:
    a package's ``__init__.py``) that pulls in a conftest or a test module."""
    test_stems = _test_module_names()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in _imported(node, module, is_init):
                why = _forbidden(name, test_stems)
                if why:
                    found.append(f"{node.lineno}: imports {name} ({ast.get_source_segment(source, node)}): {why}")
    return found


def test_no_module_under_tests_imports_a_conftest_or_a_test_module() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}" for path in _modules()
             for line in import_violations(path.read_text(), _dotted(path), path.name == "__init__.py")]
    assert not found, "modules under tests/ import what they must not:\n" + "\n".join(found)


def test_the_import_check_names_each_forbidden_import() -> None:
    """The check itself: every form of a forbidden import is found, with its line (absolute, relative, bare, inside
    a function); helpers and kv8 modules are not."""
    source = "\n".join([
        "from tests.conftest import make_tiny_model",
        "import tests.conftest",
        "from tests import conftest",
        "from . import test_engine",
        "from .test_engine import PROMPTS",
        "from ..kernels.conftest import kernel_path",
        "import tests.cache.test_budget as budget",
        "import test_engine",
        "from tests.helpers.engine import make_llm",
        "from tests.helpers import engine",
        "from . import test_sliding_window as sw, test_sampling",
        "from kv8.engine import scheduler",
        "def f():",
        "    from tests.entrypoints import test_server_faults",
        "",
    ])
    found = [line.split(" (")[0] for line in import_violations(source, "tests.engine.test_probe")]
    assert found == [
        "1: imports tests.conftest",
        "2: imports tests.conftest",
        "3: imports tests.conftest",
        "4: imports tests.engine.test_engine",
        "5: imports tests.engine.test_engine",
        "6: imports tests.kernels.conftest",
        "7: imports tests.cache.test_budget",
        "8: imports test_engine",
        "11: imports tests.engine.test_sliding_window",
        "11: imports tests.engine.test_sampling",
        "14: imports tests.entrypoints.test_server_faults",
    ], found


def test_every_test_directory_is_a_package_that_mirrors_one() -> None:
    """Each directory of tests/ that holds Python has an ``__init__.py``, and is named after a package of kv8/ (whose
    modules its files test), or is one of :data:`NOT_MIRRORS`."""
    problems = []
    for directory in sorted({p.parent for p in _modules()} - {TESTS}):
        rel = directory.relative_to(TESTS)
        if not (directory / "__init__.py").exists():
            problems.append(f"tests/{rel} has no __init__.py")
        if rel.parts[0] in NOT_MIRRORS:
            continue
        if not (ROOT / "kv8" / rel / "__init__.py").exists():
            problems.append(f"tests/{rel} mirrors no package kv8/{rel}")
    assert not problems, "\n".join(problems)
