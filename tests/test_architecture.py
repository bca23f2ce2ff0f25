"""The import-linter contracts in pyproject.toml (run by scripts/test.sh) cover the whole package: every package
and top-level module of kv8 is in a layer, so a new one cannot sit outside the architecture unchecked."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _layer_members(contract: dict) -> set[str]:
    return {name.strip() for layer in contract["layers"] for name in layer.replace(":", "|").split("|")}


def test_every_package_and_module_of_kv8_is_in_a_layer() -> None:
    children = {f"kv8.{p.stem if p.is_file() else p.name}" for p in (ROOT / "kv8").iterdir()
                if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    children.discard("kv8.__main__")   # `python -m kv8`: the command line, imported by nothing
    layers = next(c for c in _contracts() if c["name"] == "kv8's packages are layers")
    assert children == _layer_members(layers)


def test_every_entry_point_is_in_a_layer() -> None:
    base = ROOT / "kv8" / "entrypoints"
    children = {f"kv8.entrypoints.{p.stem if p.is_file() else p.name}" for p in base.iterdir()
                if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    layers = next(c for c in _contracts() if c["name"].startswith("The entry points are layers"))
    assert children == _layer_members(layers)


def test_cycles_are_checked_from_the_root() -> None:
    acyclic = next(c for c in _contracts() if c["type"] == "acyclic_siblings")
    assert acyclic["ancestors"] == ["kv8"] and acyclic.get("depth", 10) >= 4
