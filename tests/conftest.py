"""Suite-wide pytest hooks: folder markers, the GPU skip, and how ``pytest -n`` shares the
tests between workers.

Tests under ``tests/gpu/`` are marked ``gpu`` and tests under ``tests/dist/`` are marked ``dist``
automatically. Tests marked ``gpu`` are skipped when ``torch.cuda.is_available()`` is false.

``make test`` runs the suite on two pytest-xdist workers (CI has two cores). The files of
``tests/dist/`` that start ranks of their own and time them (faults, hangs, lost hosts,
heartbeats, sandbox hosts, a Slurm controller, pods) go to one worker, one test after another:
two of them at once on two cores would starve each other's heartbeats. Every other file goes
whole, its module fixtures built once, to whichever worker is free: those of ``tests/dist/``
that run their ranks as threads of the test's process, and those whose ranks are processes
but only compute, with generous limits (``_ALONGSIDE``: at most one of them runs beside the
timed files; without them the timed worker was the whole suite's critical path).
"""

from __future__ import annotations

from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
_FOLDER_MARKERS = {"gpu": "gpu", "dist": "dist"}


_REPO = _TESTS.parent


def _skip_root_package_setup(items: list[pytest.Item]) -> None:
    """The repository root IS the package ``meshplan`` (it has an ``__init__.py``), so pytest
    collects it as a ``Package`` whose setup imports that ``__init__.py`` under the folder's own
    name (``main``; an ImportError for a folder like ``ci-clone``): a second copy of meshplan.
    The tests import the installed ``meshplan``; the root package needs no setup."""
    for item in items:
        for node in item.listchain():
            if isinstance(node, pytest.Package) and Path(node.path).resolve() == _REPO:
                node.setup = lambda: None  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    """Runs started by tests record telemetry into a throwaway store, never into the
    repository's ``.meshplan/`` (tests that check telemetry pass their own path).

    ``python -m pytest`` puts the working directory (the repository root) on ``sys.path``,
    which makes the package's own folders importable as top-level packages (``kernels``,
    ``planner``...): libraries that probe for a package of that name (transformers looks for
    HuggingFace's ``kernels``) would find ours. The tests import the installed ``meshplan``,
    so the root comes off ``sys.path``."""
    import os
    import sys
    import tempfile

    sys.path[:] = [p for p in sys.path
                   if Path(p or os.getcwd()).resolve() != _REPO]

    # (an xdist worker inherits the controller's environment: each gets its own store, which
    # one process at a time can open, and its own cache)
    ours = os.environ.get("MESHPLAN_TEST_OWNS_PATHS") == "1"
    if "MESHPLAN_TELEMETRY" not in os.environ or ours:
        root = tempfile.mkdtemp(prefix="meshplan-test-telemetry-")
        os.environ["MESHPLAN_TELEMETRY"] = os.path.join(root, "telemetry.duckdb")
        os.environ["MESHPLAN_TEST_OWNS_PATHS"] = "1"
    # the mpi launcher pushes plans (and checkpoints) into a per-host cache: not the user's
    if "MESHPLAN_CACHE" not in os.environ or ours:
        os.environ["MESHPLAN_CACHE"] = tempfile.mkdtemp(prefix="meshplan-test-cache-")
        os.environ["MESHPLAN_TEST_OWNS_PATHS"] = "1"

    # Without a GPU, meshplan.kernels' Triton kernels run under Triton's interpreter, which Triton
    # reads when a kernel is defined: set it before any test module imports one.
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _skip_root_package_setup(items)
    for item in items:
        try:
            folder = Path(item.path).resolve().relative_to(_TESTS).parts[0]
        except ValueError:
            folder = ""
        if folder in _FOLDER_MARKERS:
            item.add_marker(_FOLDER_MARKERS[folder])

    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch  # only paid for when a GPU test was collected

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU: torch.cuda.is_available() is false")
    for item in gpu_items:
        item.add_marker(skip)


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:          # pytest without xdist: the suite runs in one process
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:
    # tests/dist/ files whose ranks are threads of the test's process (ThreadMesh)
    _IN_PROCESS = frozenset({"tests/dist/test_lower.py", "tests/dist/test_lower_kernels.py",
                             "tests/dist/test_memory_model.py"})
    # process ranks that only compute (no fault, hang or lost host; limits of 60 s and more)
    _ALONGSIDE = frozenset({"tests/dist/test_transfer.py", "tests/dist/test_user_programs.py",
                            "tests/dist/test_hf_models.py", "tests/dist/test_checkpoint.py",
                            "tests/dist/test_microbatch.py", "tests/dist/test_pipeline_run.py"})

    class _OneDistWorker(LoadScopeScheduling):
        """The ``tests/dist/`` files that start processes as one unit of work, every other
        file as its own (module docstring)."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path.startswith("tests/dist/") and path not in _IN_PROCESS | _ALONGSIDE:
                return "tests/dist"
            return path

    def pytest_xdist_make_scheduler(config: pytest.Config, log) -> LoadScopeScheduling:  # noqa: ANN001
        return _OneDistWorker(config, log)
