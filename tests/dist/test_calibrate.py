"""``calibrate`` measures this machine for real: two gloo processes over loopback, a matmul, a
copy, collectives from 1 KiB to 4 MiB (planner/_calibrate.py, ``meshplan calibrate``).

Measured numbers vary with the machine and its load, so the checks are plausibility bounds,
wide on purpose: link bandwidth 10 MB/s - 100 GB/s, latency 1 us - 10 ms, and compute and memory
rates within a few orders of magnitude of a laptop core. The fitting itself is checked exactly
on synthetic samples, and the failure paths (a crashing rank, a timeout, a taken port) with
stand-in workers that need no torch import.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from meshplan._errors import RuntimeFailure
from meshplan.planner import Collective, Link, PlanError, collective_time, get_topology
from meshplan.planner import _calibrate
from meshplan.planner._calibrate import Calibration, Sample, fit_link, measure

SMALL = (1 << 10, 1 << 14, 1 << 18, 1 << 22)     # 1 KiB .. 4 MiB


@pytest.fixture(scope="module")
def measured() -> Calibration:
    return measure(world_size=2, sizes=SMALL, repeats=2, timeout_s=90)


@pytest.mark.timeout(120)
def test_calibrated_topology_is_plausible(measured) -> None:
    t = measured.topology
    assert t.name == "calibrated" and t.intra_node == t.inter_node
    link = t.intra_node
    assert 10e6 <= link.bandwidth <= 100e9, link
    assert 1e-6 <= link.latency <= 10e-3, link
    flops = dict(t.flops)
    assert set(flops) == {"float32", "float64", "bfloat16"}
    assert 1e8 <= flops["float32"] <= 1e14
    assert all(v > 0 for v in flops.values())
    assert 1e8 <= t.memory_bandwidth <= 1e13
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert t.memory_bytes == ram // 2                     # an even share of RAM per process
    assert t.devices_per_node >= max(64, os.cpu_count() or 1)
    assert 1e-8 <= t.kernel_floor_s <= 1e-2
    assert t.compute_efficiency == 1.0


@pytest.mark.timeout(120)
def test_every_size_and_collective_was_measured(measured) -> None:
    got = {(s.collective, s.nbytes) for s in measured.samples}
    assert got == {(c, n) for c in _calibrate.COLLECTIVES for n in SMALL}
    assert all(s.seconds > 0 for s in measured.samples)
    assert set(measured.fits) == set(_calibrate.COLLECTIVES)
    assert measured.world_size == 2 and measured.threads >= 1
    assert set(measured.phase_s) == {"start", "compute", "memory", "collectives"}


@pytest.mark.timeout(120)
def test_cli_prints_the_numbers_and_writes_a_loadable_topology(measured, tmp_path, capsys,
                                                               monkeypatch) -> None:
    """The CLI's own wiring; the measurement is the module's real one (one run of workers
    per test module keeps this file fast)."""
    from meshplan.cli import main

    calls = []
    monkeypatch.setattr(_calibrate, "measure", lambda *a, **k: calls.append((a, k)) or measured)
    out = tmp_path / "topology.json"
    assert main(["calibrate", "--quick", "--world-size", "2", "--out", str(out)]) == 0
    (args, kwargs), = calls
    assert args == (2,) and kwargs == {"timeout_s": 120.0, "sizes": _calibrate.QUICK_SIZES,
                                       "repeats": 2}
    printed = capsys.readouterr().out
    for word in ("float32 matmul", "link bandwidth", "link latency", "all_reduce", "4.00 MiB",
                 str(out)):
        assert word in printed
    assert get_topology(str(out)) == measured.topology
    assert json.loads(out.read_text())["name"] == "calibrated"
    assert [p.name for p in tmp_path.iterdir()] == ["topology.json"]    # no temporary left


def test_cli_reports_a_failed_calibration_in_one_line(monkeypatch, capsys) -> None:
    from meshplan.cli import main

    monkeypatch.setattr(_calibrate, "_worker", _crashing_worker)
    assert main(["calibrate", "--quick"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("RuntimeFailure: calibrate: worker rank") and "Traceback" not in err


# ---- fitting, exactly ------------------------------------------------------------------------

def _synthetic(link: Link, n: int, sizes=SMALL + (1 << 26,)) -> list[Sample]:
    return [Sample(c, s, collective_time(c, s, n, link))
            for c in _calibrate.COLLECTIVES for s in sizes]


@pytest.mark.parametrize("n", [2, 4])
def test_fit_recovers_the_link_that_made_the_samples(n) -> None:
    truth = Link(bandwidth=1.25e9, latency=80e-6)
    fit = fit_link(_synthetic(truth, n), n)
    assert fit.bandwidth == pytest.approx(truth.bandwidth, rel=1e-9)
    assert fit.latency == pytest.approx(truth.latency, rel=1e-9)


def test_fit_clamps_latency_at_zero() -> None:
    truth = Link(bandwidth=1e9, latency=0.0)
    samples = [Sample(s.collective, s.nbytes, s.seconds * (0.9 if s.nbytes < 1 << 12 else 1.0))
               for s in _synthetic(truth, 2)]            # small ones faster than pure bandwidth
    fit = fit_link(samples, 2)
    assert fit.latency == 0.0 and fit.bandwidth == pytest.approx(1e9, rel=0.05)


def test_fit_refuses_times_that_shrink_with_size() -> None:
    samples = [Sample(Collective.ALL_REDUCE, 1 << 10, 1e-3),
               Sample(Collective.ALL_REDUCE, 1 << 20, 1e-4)]
    with pytest.raises(RuntimeFailure, match="do not grow with message size"):
        fit_link(samples, 2)


def test_fit_needs_two_sizes() -> None:
    with pytest.raises(PlanError, match="two message sizes"):
        fit_link([Sample(Collective.ALL_REDUCE, 1024, 1e-4)] * 3, 2)


# ---- bad arguments and failing workers (no torch import in the workers) ------------------

@pytest.mark.parametrize(("kwargs", "match"), [
    ({"world_size": 1}, "world_size >= 2"),
    ({"sizes": (1024,)}, "at least two different message sizes"),
    ({"sizes": (0, 1024)}, "byte counts >= 8"),
    ({"repeats": 0}, "repeats must be a positive integer"),
    ({"timeout_s": 0}, "timeout_s must be positive"),
    ({"threads": 0}, "threads must be a positive integer"),
])
def test_bad_arguments(kwargs, match) -> None:
    with pytest.raises(PlanError, match=match):
        measure(**kwargs)


def _crashing_worker():
    import os
    import sys

    print(f"rank {os.environ['RANK']} failed on purpose", flush=True)
    sys.exit(3)


def _sleeping_worker():
    import time

    print("sleeping", flush=True)
    time.sleep(600)


def _port_taken_worker():
    print("DistNetworkError: ... name: EADDRINUSE, message: address already in use", flush=True)
    raise SystemExit(1)


def _children() -> set[int]:
    kids: set[int] = set()
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/children", encoding="ascii") as f:
            kids.update(int(p) for p in f.read().split())
    return kids


def test_a_crashing_rank_is_reported_with_its_output(monkeypatch) -> None:
    monkeypatch.setattr(_calibrate, "_worker", _crashing_worker)
    with pytest.raises(RuntimeFailure, match=r"(?s)rank \d exited with code 3.*failed on purpose"):
        measure(sizes=SMALL, timeout_s=30)


@pytest.mark.timeout(30)
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads children from /proc")
def test_a_timeout_kills_the_workers(monkeypatch) -> None:
    monkeypatch.setattr(_calibrate, "_worker", _sleeping_worker)
    before = _children()
    start = time.monotonic()
    with pytest.raises(RuntimeFailure, match=r"(?s)ranks \[0, 1\] did not finish within 1 s.*"
                       r"--timeout.*sleeping"):
        measure(sizes=SMALL, timeout_s=1)
    assert time.monotonic() - start < 10
    assert _children() <= before                           # nothing left running


def test_a_taken_port_is_retried_once(monkeypatch) -> None:
    ports = []
    monkeypatch.setattr(_calibrate, "_worker", _port_taken_worker)
    monkeypatch.setattr(_calibrate, "_free_port", lambda: ports.append(1) or 1)
    with pytest.raises(RuntimeFailure, match="ports were taken"):
        measure(sizes=SMALL, timeout_s=30)
    assert len(ports) == 2


def test_cli_checks_the_out_folder_before_measuring(monkeypatch, capsys, tmp_path) -> None:
    from meshplan.cli import main

    monkeypatch.setattr(_calibrate, "measure", lambda *a, **k: pytest.fail("measured anyway"))
    assert main(["calibrate", "--out", str(tmp_path / "missing" / "t.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("PlanError: --out") and "does not exist; create it first" in err


def test_flat_collective_times_are_measured_again(monkeypatch) -> None:
    """A busy machine can make a 1 KiB collective as slow as a 4 MiB one (the fit then has
    no bandwidth): ``measure`` runs the workers again, up to ``FLAT_ATTEMPTS`` times, and
    only then fails, saying it measured that often."""
    runs, flat = [], [2]

    def combine(ranks, cfg, wall_s):
        runs.append(1)
        if len(runs) <= flat[0]:
            raise _calibrate._FlatTimes("calibrate: collective times do not grow with message "
                                        "size, so no bandwidth can be fitted (samples: [])")
        return "the calibration"

    monkeypatch.setattr(_calibrate, "_run_workers", lambda cfg: [])
    monkeypatch.setattr(_calibrate, "_combine", combine)
    assert measure(world_size=2, sizes=SMALL) == "the calibration" and len(runs) == 3
    runs.clear()
    flat[0] = 3                        # every attempt is flat
    with pytest.raises(RuntimeFailure, match=r"do not grow with message size.*measured 3 "
                                             r"times; is the machine busy"):
        measure(world_size=2, sizes=SMALL)
