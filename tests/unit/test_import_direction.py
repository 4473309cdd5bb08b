"""Imports flow one way through the pipeline stages (README, "Layout").

Every ``.py`` file under a stage folder is parsed with ``ast`` (nothing is imported) and each of its
imports of ``meshplan`` -- absolute (``import meshplan.x``, ``from meshplan import x``), relative
(``from ..ir import Graph``, ``from . import x``) or by string (``importlib.import_module``) -- is
checked against the table below. Imports under ``if TYPE_CHECKING:`` count too: a type-only edge
against the direction is still a layering mistake.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "meshplan"

# The shared error hierarchy: every stage may import it, and it imports nothing of ours.
ERRORS = "_errors"
# Telemetry is a leaf that every stage except `ir` ("imports nothing") may import.
TELEMETRY = "telemetry"
ROOT_API = "meshplan (root public API)"
BEYOND_ROOT = "<relative import beyond the package root>"

# stage -> the other parts of meshplan it may import (besides itself and _errors).
ALLOWED: dict[str, frozenset[str]] = {
    "ir": frozenset(),
    "frontend": frozenset({"ir", TELEMETRY}),
    "planner": frozenset({"ir", "kernels", TELEMETRY}),     # the fused kernels it prices
    "kernels": frozenset({"ir", TELEMETRY}),
    "backends": frozenset({"ir", "planner", "kernels", TELEMETRY}),
    "runtime": frozenset({"ir", "frontend", "planner", "kernels", "backends", TELEMETRY}),
    TELEMETRY: frozenset(),
    ERRORS: frozenset(),
}
STAGES = tuple(name for name in ALLOWED if name != ERRORS)
# Top-level parts of meshplan that an import can name; anything else resolves to the root API.
KNOWN_PARTS = frozenset(ALLOWED) | {"examples", "cli", BEYOND_ROOT}


@dataclass(frozen=True, slots=True)
class Violation:
    path: str
    line: int
    importer: str
    target: str
    statement: str

    def __str__(self) -> str:
        allowed = sorted(ALLOWED[self.importer] | {ERRORS}) if self.importer in ALLOWED else []
        return (
            f"{self.path}:{self.line}: forbidden import edge {self.importer} -> {self.target}"
            f" ({self.statement}); {self.importer} may import only {', '.join(allowed) or 'nothing'}"
            " of meshplan (the table in README.md, \"Layout\")"
        )


def module_name(rel_path: str) -> str:
    """Dotted module name of a file given relative to the repository root (the package root)."""
    parts = list(Path(rel_path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def part_of(dotted: str) -> str | None:
    """The top-level part of meshplan a dotted name lives in; None when it is not ours."""
    pieces = dotted.split(".")
    if pieces[0] != PACKAGE:
        return None
    if len(pieces) == 1 or pieces[1] not in KNOWN_PARTS:
        return ROOT_API
    return pieces[1]


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str | None:
    """Absolute name of ``from <level dots><name> import ...`` inside ``module``; None if too deep."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 > len(base) - 1:
        return None
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names (possibly not ours) that one AST node imports."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = _resolve_relative(module, is_package, node.level, node.module)
            if base is None:
                return [f"{PACKAGE}.{BEYOND_ROOT}"]
        else:
            base = node.module or ""
        # `from pkg import x` may name a submodule: judge by the longest name it can mean.
        return [f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names]
    if isinstance(node, ast.Call) and _is_dynamic_import(node.func):
        first = node.args[0] if node.args else None
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return [first.value]
    return []


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in {"__import__", "import_module"}
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def check_source(source: str, rel_path: str) -> list[Violation]:
    """Every forbidden import edge in ``source``, which lives at ``rel_path`` in the repository."""
    importer = Path(rel_path).parts[0] if len(Path(rel_path).parts) > 1 else Path(rel_path).stem
    allowed = ALLOWED[importer] | {importer, ERRORS}
    module = module_name(rel_path)
    is_package = Path(rel_path).name == "__init__.py"
    violations = []
    for node in ast.walk(ast.parse(source, filename=rel_path)):
        for target in _targets(node, module, is_package):
            part = part_of(target)
            if part is not None and part not in allowed:
                statement = ast.get_source_segment(source, node) or type(node).__name__
                violations.append(
                    Violation(rel_path, node.lineno, importer, part, " ".join(statement.split()))
                )
    return sorted(violations, key=lambda v: v.line)


def stage_files(stage: str) -> list[Path]:
    """The Python files of one stage: a folder, or the single module ``_errors.py``."""
    if stage == ERRORS:
        path = REPO_ROOT / f"{ERRORS}.py"
        return [path] if path.exists() else []
    return sorted(
        path
        for path in (REPO_ROOT / stage).rglob("*.py")
        if "__pycache__" not in path.parts
    )


@pytest.mark.parametrize("stage", list(ALLOWED))
def test_stage_imports_flow_one_way(stage: str) -> None:
    violations = []
    for path in stage_files(stage):
        rel_path = path.relative_to(REPO_ROOT).as_posix()
        violations += check_source(path.read_text(encoding="utf-8"), rel_path)
    assert not violations, "\n".join(map(str, violations))


def test_every_stage_folder_exists() -> None:
    missing = [stage for stage in STAGES if not (REPO_ROOT / stage).is_dir()]
    assert not missing, f"stage folders missing at {REPO_ROOT}: {missing}"


# --- self-tests: the checker must catch what it claims to catch ----------------------------------


@pytest.mark.parametrize(
    ("rel_path", "source", "edge"),
    [
        ("ir/graph.py", "from ..planner import Plan\n", ("ir", "planner")),
        ("ir/graph.py", "import os\nimport meshplan.telemetry.store\n", ("ir", TELEMETRY)),
        ("ir/__init__.py", "from .. import frontend\n", ("ir", "frontend")),
        ("frontend/trace.py", "from meshplan import planner\n", ("frontend", "planner")),
        ("planner/rules/mm.py", "from ...backends.lower import lower\n", ("planner", "backends")),
        ("kernels/triton_mm.py", "from meshplan.backends.comm import Comm\n", ("kernels", "backends")),
        ("backends/lower.py", "from ..runtime import Controller\n", ("backends", "runtime")),
        ("backends/lower.py", "from meshplan import distribute\n", ("backends", ROOT_API)),
        ("runtime/worker.py", "import meshplan\n", ("runtime", ROOT_API)),
        ("runtime/worker.py", "from .. import cli\n", ("runtime", "cli")),
        ("runtime/worker.py", "from .... import x\n", ("runtime", BEYOND_ROOT)),
        ("telemetry/store.py", "from ..ir import Graph\n", (TELEMETRY, "ir")),
        ("_errors.py", "from meshplan.ir import Graph\n", (ERRORS, "ir")),
        (
            "planner/solve.py",
            "import importlib\nm = importlib.import_module('meshplan.runtime.launch')\n",
            ("planner", "runtime"),
        ),
        (
            "ir/nodes.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from meshplan.planner import Plan\n",
            ("ir", "planner"),
        ),
    ],
)
def test_checker_catches_forbidden_edge(rel_path: str, source: str, edge: tuple[str, str]) -> None:
    violations = check_source(source, rel_path)
    assert [(v.importer, v.target) for v in violations] == [edge]
    message = str(violations[0])
    last_line = len(source.rstrip("\n").splitlines())
    assert message.startswith(f"{rel_path}:{last_line}: forbidden import edge {edge[0]} -> {edge[1]}")


@pytest.mark.parametrize(
    ("rel_path", "source"),
    [
        ("ir/graph.py", "from . import nodes\nfrom .nodes import Node\nfrom .._errors import IRError\n"),
        ("ir/passes/dce.py", "from ..graph import Graph\nfrom meshplan.ir import verify\n"),
        ("frontend/trace.py", "from ..ir import Graph\nfrom meshplan.telemetry import record\n"),
        ("planner/rules/mm.py", "from ...ir import TensorMeta\nfrom .. import cost\n"),
        ("kernels/registry.py", "from meshplan import ir\nimport numba, torch\n"),
        ("backends/lower.py", "from ..planner import Plan\nfrom ..kernels import pick\nimport meshplan.ir\n"),
        ("runtime/controller.py", "from .. import frontend, planner, backends, kernels, ir, telemetry\n"),
        ("telemetry/store.py", "import duckdb\nfrom meshplan._errors import TelemetryError\n"),
        ("runtime/x.py", "import meshplanner\nfrom meshplan_ext import thing\n"),
    ],
)
def test_checker_allows_permitted_edges(rel_path: str, source: str) -> None:
    assert check_source(source, rel_path) == []


def test_relative_import_resolution() -> None:
    assert _resolve_relative("meshplan.planner.rules.mm", False, 1, None) == "meshplan.planner.rules"
    assert _resolve_relative("meshplan.planner.rules.mm", False, 3, "ir") == "meshplan.ir"
    assert _resolve_relative("meshplan.planner.rules", True, 1, "mm") == "meshplan.planner.rules.mm"
    assert _resolve_relative("meshplan.ir", True, 2, None) == "meshplan"
    assert _resolve_relative("meshplan.ir", True, 3, None) is None
