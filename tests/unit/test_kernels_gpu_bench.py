"""Smoke test of ``benchmarks/kernels_gpu.py``: the GPU kernel benchmark runs in ``--quick``
mode on the CPU under the Triton interpreter (a subprocess with ``CUDA_VISIBLE_DEVICES=""`` and
``TRITON_INTERPRET=1``), and its JSON has one finished row per kernel and pass for every
requested kernel and dtype, with finite times and the fused results within tolerance of the
float32 torch reference. Timings under the interpreter mean nothing; only the plumbing and the
numerics are checked. float32 only, to stay within ~30 s (fp16 is covered by
``test_kernels_triton.py``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels_gpu.py"
KERNELS = ["adamw", "sgd", "cross_entropy", "bias_gelu", "swiglu", "layer_norm", "rms_norm",
           "pack_views"]
PASSES = {"adamw": {"step"}, "sgd": {"step"}, "pack_views": {"pack", "unpack"}}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.mark.timeout(120)
def test_quick_run_on_cpu_reports_every_kernel_within_tolerance(tmp_path) -> None:
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--kernels", ",".join(KERNELS), "--dtypes",
         "float32", "--json", str(out), "--markdown", str(md)],
        env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["interpret"] is True and report["cuda"] is False
    assert report["torch"] and report["triton"] and report["device"]
    assert _finite(report["copy_bandwidth"]["GBps"]) and report["copy_bandwidth"]["GBps"] > 0
    rows = report["rows"]
    for kernel in KERNELS:
        passes = {r["pass"] for r in rows if r["kernel"] == kernel and r["dtype"] == "float32"}
        assert passes == PASSES.get(kernel, {"fwd", "fwd+bwd"}), (kernel, passes)
    assert len(rows) == sum(len(PASSES.get(k, {"fwd", "fwd+bwd"})) for k in KERNELS)
    for r in rows:
        what = f"{r['kernel']} {r['dtype']} {r['pass']}: {r}"
        for key in ("skipped", "error", "fused_error", "check_error"):
            assert key not in r, what
        assert r["ok"] is True, what
        assert _finite(r["max_abs_err"]) and _finite(r["max_rel_err"]), what
        assert r["max_rel_err"] <= r["tol"] == 1e-4, what
        assert _finite(r["fused_ms"]) and r["fused_ms"] > 0, what
        assert r["bytes"] > 0 and _finite(r["GBps"]) and _finite(r["frac_copy_bw"]), what
        base = r["torch_ms"][r["baseline"]]
        assert _finite(base) and base > 0, what
        assert _finite(r["speedup"][r["baseline"]]), what
    adamw = next(r for r in rows if r["kernel"] == "adamw")
    assert set(adamw["torch_ms"]) == {"foreach=False", "foreach=True", "fused=True"}
    assert _finite(adamw["fused_variants_ms"]["launch-only"])
    sgd = next(r for r in rows if r["kernel"] == "sgd")     # the old one launch per shard
    assert _finite(sgd["fused_variants_ms"]["per-shard"])
    assert "| adamw | float32 | step |" in md.read_text()


def test_failed_rows_make_the_run_fail() -> None:
    """The script's exit status comes from ``failures(report)``: a row with an error in any
    measurement, a row whose result is out of tolerance, or an interrupted run is a failure,
    named; rows skipped for the time budget are not."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kernels_gpu_under_test", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench                 # its dataclasses look their module up
    try:
        spec.loader.exec_module(bench)
    finally:
        del sys.modules[spec.name]
    good = {"kernel": "adamw", "dtype": "float32", "pass": "step", "ok": True, "tol": 1e-4,
            "max_rel_err": 1e-7, "torch_ms": {"foreach=False": 1.0},
            "fused_variants_ms": {"launch-only": 0.1}}
    assert bench.failures({"rows": [good, {**good, "skipped": "time budget: 99 s > 95"}]}) == []
    cases = {"check_error": {**good, "ok": False, "check_error": "RuntimeError: boom"},
             "max rel err 0.5": {**good, "ok": False, "max_rel_err": 0.5},
             "launch-only: ValueError": {**good, "fused_variants_ms": {"launch-only":
                                                                       "ValueError: x"}},
             "fused_error": {**good, "fused_error": "CUDA error"}}
    for needle, row in cases.items():
        got = bench.failures({"rows": [good, row]})
        assert len(got) == 1 and needle in got[0] and got[0].startswith("adamw float32 step"), got
    assert bench.failures({"rows": [good], "interrupted": True})
