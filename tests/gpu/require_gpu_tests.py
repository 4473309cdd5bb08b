"""pytest plugin for the GPU machine (``device_check.sh`` loads it with ``-p
require_gpu_tests``): there a skipped test that needs the GPU is a failure, not a pass.

CI has no GPU, so ``tests/conftest.py`` skips the tests marked ``gpu`` there; on the machine
lent for the GPU checks, a skip would let the run pass without running what it is for. This
plugin fails the run (exit status 1, after pytest's own summary) when

- a test marked ``gpu`` is skipped (for any reason: no CUDA device, a missing package), or
- a whole file is skipped while being collected (``pytest.importorskip`` at module level, as
  ``test_kernels_triton.py`` does for triton), since that hides its tests' markers,

and names each one. Other skips (the Triton-interpreter tests, which need a CPU-only process)
stay skips and are listed by ``-rs`` as usual.
"""

from __future__ import annotations

import pytest

_skipped: list[str] = []


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:
        _skipped.append(f"{report.nodeid or '<collection>'} (whole file skipped: "
                        f"{_reason(report)})")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and "gpu" in report.keywords:
        _skipped.append(f"{report.nodeid} (marked gpu, skipped: {_reason(report)})")


def _reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:       # (file, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)[:200]


def pytest_terminal_summary(terminalreporter) -> None:
    if _skipped:
        terminalreporter.section("skipped on the GPU machine: counted as failures", red=True)
        for line in _skipped:
            terminalreporter.write_line(f"FAILED (skip) {line}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
