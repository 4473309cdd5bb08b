"""``meshplan calibrate --from-telemetry``: links fitted to a recorded run's collectives.

The run is synthetic: collective durations made by the cost model's own alpha-beta formulas
from a known link (plus the per-rank jitter a real run has), so the fit must find that link
back; 2% on latency and bandwidth is far inside what distinguishes a loopback link from
NVLink, and far outside the jitter's effect on a median.
"""

from __future__ import annotations

import json

import pytest

from meshplan._errors import PlanError
from meshplan.planner._calibrate import from_telemetry
from meshplan.planner._comm import Collective, collective_time
from meshplan.planner._mesh import Link
from meshplan.planner._problem import _compute_time
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
        fit = from_telemetry(store)
    topo, samples, link = fit.topology, fit.samples, fit.link
    assert fit.compute is None                      # no op times: compute from the preset
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
        topo = from_telemetry(store, "run1", "h100").topology
    assert topo.name == "h100+run-run1"


def test_a_store_without_runs_says_so(tmp_path) -> None:
    with Store.open(tmp_path / "empty.duckdb") as store:
        with pytest.raises(PlanError, match="no runs"):
            from_telemetry(store)


# ---- compute: rates, per-op factors and the step overhead ------------------------------------

def _op_rows(truth) -> list[dict]:
    """Planned nodes of three kinds (compute-bound matmuls, memory-bound elementwise ops, tiny
    ops at the floor) with their per-rank work, and the time ``truth`` gives each (an
    attention op 3x slower than its roofline, as the CPU's is)."""
    from meshplan.planner._problem import _compute_time

    rows = []
    for i in range(12):
        n = 128 * (1 + i % 4)
        rows.append(("aten.mm.default", 2.0 * n ** 3, 12.0 * n * n))
        rows.append(("aten.addmm.default", 2.0 * n ** 3 + n * n, 12.0 * n * n))
        for op in ("add.Tensor", "gelu.default", "native_layer_norm.default"):
            rows.append((f"aten.{op}", float(n * n), 12.0 * n * n))
        rows.append(("aten.mul.Tensor", 16.0, 64.0))
    rows.append(("aten.sdpa.default", 1.0e6, 8.0e6))
    return [dict(node=f"n{k}", target=t, flops=f, bytes=b,
                 us=_compute_time(f, b, 1, "float32", truth, t) * 1e6)
            for k, (t, f, b) in enumerate(rows)]


def _record_ops(db, truth, overhead_s: float) -> float:
    """A run whose ranks timed every planned node as ``truth`` prices it, and whose steps took
    those times plus ``overhead_s``; returns the step time."""
    root = segments_dir(db)
    rows = _op_rows(truth)
    ctl = Recorder(root, "run1", -1, flush_interval_s=None)
    ctl.add("runs", (1, "step", '{"dp": 2}', 2, "dp", "cpu", "h", 1.0, 1, "ops", "host", 1,
                     "0.1", "2.13"))
    ctl.add_many("plan_nodes", [(r["node"], r["target"], "op", "forward", "m", None, "", "", 0.0,
                                 r["flops"], r["bytes"], "float32", None) for r in rows])
    # two fused AdamW kernels' matches (anchor: the kernel's work; members: none), which the
    # ranks run as one call "k0+1" taking half the kernel's roofline
    kernel = "kernel.adamw_cpu"
    ctl.add_many("plan_nodes", [
        (f"k{m}{part}", target, "op", "optimizer", "m", None, "", "", 0.0, work, 7 * work,
         "float32", kernel)
        for m in range(2)
        for part, target, work in (("", "aten.addcdiv.default", 4.0e6),
                                   ("_mul", "aten.mul.Tensor", 0.0))])
    kernel_us = 0.5 * _compute_time(8.0e6, 56.0e6, 1, "float32", truth, None) * 1e6
    step_s = (sum(r["us"] for r in rows) + kernel_us) * 1e-6 + overhead_s
    for step in range(4):
        ctl.add("steps", (step, 0, int(step_s * 1e6 * (3 if step == 0 else 1)), 1.0, None,
                          None, None))
    ctl.close()
    for rank in range(2):
        rec = Recorder(root, "run1", rank, flush_interval_s=None)
        for step in range(4):
            slow = 5 if step == 0 else 1                  # the first step warms up: left out
            rec.add_many("ops", [(step, k, r["node"], r["target"], 0, int(r["us"] * slow))
                                 for k, r in enumerate(rows)])
            rec.add("ops", (step, len(rows), "k0+1", kernel, 0, int(kernel_us * slow)))
        rec.close()
    return step_s


def test_compute_rates_op_factors_and_step_overhead_are_fitted_back(tmp_path) -> None:
    """Op times made by the cost model itself from a known machine (37 GFLOP/s, 3.4 GB/s,
    a 12 us floor, attention 3x its roofline, a fused optimizer kernel 2x faster than its
    roofline) and steps 30 ms longer than their ops: the fit finds the rates (within 3 %: op
    times are whole microseconds), the attention's and the kernel's factors (the kernel's
    calls against the work of every match it runs), and the overhead, so the run's own plan
    priced on the fitted machine is the measured step."""
    from meshplan.planner import get_topology

    truth = Topology_with(flops={"float32": 37e9}, memory_bandwidth=3.4e9,
                          kernel_floor_s=12e-6, op_factors={"aten.sdpa.default": 3.0})
    db = tmp_path / "t.duckdb"
    step_s = _record_ops(db, truth, overhead_s=0.030)
    with Store.open(db) as store:
        fit = from_telemetry(store)
    c = fit.compute
    assert fit.link is None                         # no collectives: the preset's link
    assert fit.topology.intra_node == get_topology("cpu").intra_node
    assert c.flops["float32"] == pytest.approx(37e9, rel=0.03)
    assert c.memory_bandwidth == pytest.approx(3.4e9, rel=0.03)
    assert c.kernel_floor_s == pytest.approx(12e-6, rel=0.03)
    assert c.op_factors["aten.sdpa.default"] == pytest.approx(3.0, rel=0.03)
    assert c.op_factors["kernel.adamw_cpu"] == pytest.approx(0.5, rel=0.03)
    assert all(f == pytest.approx(1.0, rel=0.03) for t, f in c.op_factors.items()
               if t not in ("aten.sdpa.default", "kernel.adamw_cpu"))
    assert fit.measured_step_s == pytest.approx(step_s, rel=1e-3)
    assert fit.topology.step_overhead_s == pytest.approx(0.030, rel=0.03)
    # the other dtypes keep the preset's ratios to float32
    base = get_topology("cpu")
    assert c.flops["bfloat16"] / c.flops["float32"] == pytest.approx(
        base.flops_for("bfloat16") / base.flops_for("float32"))


def Topology_with(**kw):  # noqa: N802 - reads as the constructor it wraps
    from dataclasses import replace

    from meshplan.planner import get_topology

    return replace(get_topology("cpu"), name="truth", compute_efficiency=1.0, **kw)


def test_a_fitted_machine_round_trips_through_its_file(tmp_path) -> None:
    from meshplan.planner import get_topology

    link = Link(bandwidth=3e9, latency=6e-5, kinds=(("all_to_all", 1e9, 1e-4),))
    topo = Topology_with(flops={"float32": 37e9}, op_factors={"aten.mm.default": 1.5},
                         step_overhead_s=0.02, intra_node=link)
    topo.save(str(tmp_path / "m.json"))
    again = get_topology(str(tmp_path / "m.json"))
    assert again == topo and again.op_factor("aten.mm.default") == 1.5
    assert again.intra_node.for_kind("all_to_all") == (1e9, 1e-4)
    assert again.op_factor("aten.add.Tensor") == 1.0


def test_the_cli_says_what_it_fitted_and_writes_a_loadable_machine(tmp_path, capsys) -> None:
    from meshplan import cli
    from meshplan.planner import get_topology

    truth = Topology_with(flops={"float32": 37e9}, memory_bandwidth=3.4e9, kernel_floor_s=12e-6)
    db = tmp_path / "t.duckdb"
    _record_ops(db, truth, overhead_s=0.010)
    out = tmp_path / "fitted.json"
    assert cli.main(["calibrate", "--from-telemetry", "--db", str(db), "-o", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "links from 'cpu' (the run's collectives do not span 16x in size" in text
    assert "compute fitted to" in text and "float32 37.0 GFLOP/s" in text
    assert "step overhead 10.0 ms" in text
    fitted = get_topology(str(out))
    assert fitted.name == "cpu+run-run1"
    assert fitted.step_overhead_s == pytest.approx(0.010, rel=0.05)
    # --json: the same fit, machine-readable on stdout (the messages on stderr)
    assert cli.main(["calibrate", "--from-telemetry", "--db", str(db), "--json"]) == 0
    captured = capsys.readouterr()
    got = json.loads(captured.out)
    assert got["source"] == "telemetry" and got["link"] is None
    assert got["compute"]["flops_per_s"]["float32"] == pytest.approx(37e9, rel=0.05)
    assert got["step_overhead_s"] == pytest.approx(0.010, rel=0.05)
    assert got["topology"]["name"] == "cpu+run-run1"
    assert "compute fitted to" in captured.err


# ---- links per collective kind, probes, what the link is not fitted to ----------------------

def _probes(db, links: dict[str, Link], sizes=(64 << 10, 1 << 20, 4 << 20, 16 << 20),
            n: int = 2) -> None:
    """The ``link_probes`` rows the controller records after ``backends/_probe.py`` ran on
    ``n`` ranks, timed by per-kind ``links`` (rank r 1 % slower per rank: the median over
    ranks is taken)."""
    ctl = Recorder(segments_dir(db), "run1", -1, flush_interval_s=None)
    for kind, link in links.items():
        for b in sizes:
            for r in range(n):
                t = collective_time(Collective(kind), b, n, link) * (1 + 0.01 * r)
                ctl.add("link_probes", (kind, "dp", n, b, t * 1e6), rank=r)
    ctl.close()


def test_probes_fit_one_link_per_collective_kind(tmp_path) -> None:
    """On shared memory an all-reduce copies in, reduces and copies out, an all-to-all only
    copies: blocking probes of each kind on the mesh give each its own link (within 2 %:
    the ranks' 1 % spread is a median away), and the plan prices each kind with its own."""
    db = tmp_path / "t.duckdb"
    _record(db, Link(bandwidth=1e6, latency=1.0))       # the run's own: must not be used
    truth = {"all_reduce": Link(bandwidth=3.8e9, latency=60e-6),
             "all_gather": Link(bandwidth=3.5e9, latency=90e-6),
             "all_to_all": Link(bandwidth=1.2e9, latency=110e-6)}
    _probes(db, truth)
    with Store.open(db) as store:
        fit = from_telemetry(store)
    assert fit.probed and len(fit.samples) == 3 * 4
    link = fit.topology.intra_node
    for kind, want in truth.items():
        bw, lat = link.for_kind(kind)
        assert bw == pytest.approx(want.bandwidth, rel=0.02), kind
        assert lat == pytest.approx(want.latency, rel=0.02), kind
        assert collective_time(Collective(kind), 1 << 20, 2, link) == pytest.approx(
            collective_time(Collective(kind), 1 << 20, 2, want), rel=0.02)
    assert link.for_kind("reduce_scatter") == (link.bandwidth, link.latency)   # not probed
    again = Link(**json_round_trip(link))
    assert again == link and again.for_kind("all_to_all") == link.for_kind("all_to_all")


def test_probed_wait_is_priced_once_per_collective(tmp_path) -> None:
    """``probe_wait``'s rows (kind ``wait``: what a blocking collective adds when every rank
    is busy) set the fitted link's ``wait``, the median over ranks; every collective call
    pays it once, whatever its size, so a plan's price grows with its number of calls. A
    topology file keeps it; one without it reads as 0, and a negative one is refused."""
    from meshplan.planner import Topology, get_topology

    db = tmp_path / "t.duckdb"
    _record(db, Link(bandwidth=1e6, latency=1.0))
    _probes(db, {"all_reduce": Link(bandwidth=3e9, latency=60e-6)})
    ctl = Recorder(segments_dir(db), "run1", -1, flush_interval_s=None)
    for r, us in enumerate((900.0, 1100.0, 1000.0)):
        ctl.add("link_probes", ("wait", "dp", 2, 4, us), rank=r)
    ctl.close()
    with Store.open(db) as store:
        fit = from_telemetry(store)
    link = fit.topology.intra_node
    assert link.wait == pytest.approx(1e-3) and fit.topology.inter_node.wait == link.wait
    bare = Link(bandwidth=link.bandwidth, latency=link.latency, kinds=link.kinds)
    for kind in Collective:
        for nbytes in (4, 1 << 20):
            assert collective_time(kind, nbytes, 4, link) == pytest.approx(
                collective_time(kind, nbytes, 4, bare) + 1e-3), (kind, nbytes)
    assert collective_time(Collective.ALL_REDUCE, 1 << 20, 1, link) == 0.0   # no group
    d = fit.topology.to_dict()
    assert d["intra_node"]["wait"] == pytest.approx(1e-3)
    assert Topology.from_dict(d) == fit.topology
    assert "wait" not in get_topology("cpu").to_dict()["intra_node"]     # files as before
    with pytest.raises(PlanError, match="wait >= 0"):
        Link(bandwidth=1e9, latency=0.0, wait=-1e-6)


def json_round_trip(link: Link) -> dict:
    import json
    from dataclasses import asdict

    return json.loads(json.dumps(asdict(link)))


def test_buckets_and_small_messages_fit_no_link(tmp_path) -> None:
    """A data-parallel run: its gradient bucket (started in the backward, finished at its end:
    the duration holds compute) and its 4- and 8-byte all-reduces (skew, not the link) give
    no link; the preset's stays."""
    from meshplan.planner import get_topology

    db = tmp_path / "t.duckdb"
    root = segments_dir(db)
    ctl = Recorder(root, "run1", -1, flush_interval_s=None)
    ctl.add("runs", (1, "step", '{"dp": 2}', 2, "dp", "cpu", "h", 1.0, 1, "collectives",
                     "host", 1, "0.1", "2.13"))
    ctl.close()
    for rank in range(2):
        rec = Recorder(root, "run1", rank, flush_interval_s=None)
        for step in range(4):
            rec.add("collectives", (step, 0, "all_reduce", "dp", 2, 4, 0, 900, "loss", "n"))
            rec.add("collectives", (step, 1, "all_reduce", "dp", 2, 8, 0, 300, "<vote>", "n"))
            rec.add("collectives", (step, 2, "all_reduce", "dp", 2, 14 << 20, 0, 90_000,
                                    "<bucket>", "<9 values>"))
        rec.close()
    with Store.open(db) as store:
        with pytest.raises(PlanError, match="16x apart"):
            from_telemetry(store)
    _probes(db, {"all_reduce": Link(3e9, 50e-6)})
    with Store.open(db) as store:
        fit = from_telemetry(store)
    assert fit.link is not None and fit.link != get_topology("cpu").intra_node
