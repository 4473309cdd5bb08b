"""``meshplan calibrate --from-telemetry``: links fitted to a recorded run's collectives.

The run is synthetic: collective durations made by the cost model's own alpha-beta formulas
from a known link (plus the per-rank jitter a real run has), so the fit must find that link
back; 2% on latency and bandwidth is far inside what distinguishes a loopback link from
NVLink, and far outside the jitter's effect on a median.
"""

from __future__ import annotations

import pytest

from meshplan._errors import PlanError
from meshplan.planner._calibrate import from_telemetry
from meshplan.planner._comm import Collective, collective_time
from meshplan.planner._mesh import Link
from meshplan.telemetry import Recorder, Store, segments_dir


def _record(db, link: Link, topology: str = "cpu") -> None:
    root = segments_dir(db)
    ctl = Recorder(root, "run1", -1, flush_interval_s=None)
    ctl.add("runs", (1, "step", '{"dp": 2, "tp": 2}', 4, "auto", topology, "h", 1.0, 1,
                     "collectives", "host", 1, "0.1", "2.13"))
    ctl.close()
    sizes = [1 << k for k in range(10, 24, 2)]
    for rank in range(4):
        rec = Recorder(root, "run1", rank, flush_interval_s=None)
        seq = 0
        for step in range(5):
            for kind, n in (("all_reduce", 2), ("all_gather", 2), ("reduce_scatter", 4)):
                for nbytes in sizes:
                    t = collective_time(Collective(kind), nbytes, n, link)
                    jitter = 1 + 0.01 * ((rank + step) % 3 - 1)
                    rec.add("collectives", (step, seq, kind, "dp", n, nbytes, 0,
                                            int(t * 1e6 * jitter), "v", "n"))
                    seq += 1
        rec.close()


def test_the_fit_finds_the_link_the_run_had(tmp_path) -> None:
    db = tmp_path / "t.duckdb"
    truth = Link(bandwidth=400e6, latency=300e-6)
    _record(db, truth)
    with Store.open(db) as store:
        topo, samples, link = from_telemetry(store)
    assert len(samples) == 3 * 7
    assert link.latency == pytest.approx(truth.latency, rel=0.02)
    assert link.bandwidth == pytest.approx(truth.bandwidth, rel=0.02)
    assert topo.intra_node == topo.inter_node == link
    assert topo.name == "cpu+run-run1" and dict(topo.flops)["float32"] == 50e9


def test_a_run_without_a_preset_topology_needs_one_named(tmp_path) -> None:
    db = tmp_path / "t.duckdb"
    _record(db, Link(bandwidth=1e9, latency=1e-4), topology="calibrated")
    with Store.open(db) as store:
        with pytest.raises(PlanError, match="--topology"):
            from_telemetry(store)
        topo, _, _ = from_telemetry(store, "run1", "h100")
    assert topo.name == "h100+run-run1"


def test_a_store_without_runs_says_so(tmp_path) -> None:
    with Store.open(tmp_path / "empty.duckdb") as store:
        with pytest.raises(PlanError, match="no runs"):
            from_telemetry(store)
