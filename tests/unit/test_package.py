"""The package is imported once, as ``meshplan``, from this repository."""

from __future__ import annotations

import sys
from pathlib import Path

import meshplan


def test_meshplan_is_this_repository() -> None:
    root = Path(__file__).resolve().parents[2]
    assert Path(meshplan.__file__).resolve() == root / "__init__.py"


def test_no_second_copy_of_the_package_is_loaded() -> None:
    """pytest must not import the repository root under another name (e.g. ``main``)."""
    ours = Path(meshplan.__file__).resolve().parent
    for name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None)
        if not path or not Path(path).is_absolute() or not Path(path).resolve().is_relative_to(ours):
            continue
        first = Path(path).resolve().relative_to(ours).parts[0]
        if first.startswith(".") or first in ("tests", "benchmarks"):  # .venv, tests
            continue
        assert name == "meshplan" or name.startswith("meshplan."), (name, path)


def test_public_surface_is_small() -> None:
    assert "trace" in meshplan.__all__ and len(meshplan.__all__) <= 20
