"""``distribute(calibrate=N)``: the first N mesh steps time their ops, the cost model's machine
is fitted to them (``planner/_calibrate.py``: ``from_telemetry``), the step is planned again,
and when the plan changes the state moves to the new plan and training goes on, equal to one
process.

One run on 2 local processes. The step starts on a made-up machine whose link is free and
whose compute is slow, so ``auto`` shards the MLP; the fit is the real one from the run, but
its link is then made 1 s per collective (a wrapper around ``from_telemetry``), so the plan
after calibration is certainly a different one (nothing to all-reduce): the test is about the
switch being exact, not about what this machine measured.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import meshplan
from meshplan._errors import RuntimeFailure
from meshplan.examples import mlp
from meshplan.planner import Link, get_topology
from meshplan.telemetry import Store, TelemetryConfig

CONFIG = mlp.MLPConfig(d_in=64, d_hidden=256, d_out=64, batch_size=32)
FREE_LINK = Link(bandwidth=1e15, latency=0.0)


def _free_link_machine():
    return dataclasses.replace(get_topology("cpu"), name="free-link", intra_node=FREE_LINK,
                               inter_node=FREE_LINK,
                               flops={"float32": 1e9, "float64": 1e9, "bfloat16": 1e9})


@pytest.mark.timeout(240)
def test_calibration_replans_and_the_step_goes_on_equal_to_one_process(tmp_path,
                                                                       monkeypatch) -> None:
    from meshplan.planner import _calibrate

    real = _calibrate.from_telemetry

    def slow_link(*args, **kwargs):
        fit = real(*args, **kwargs)
        slow = Link(bandwidth=1e3, latency=1.0)
        return dataclasses.replace(fit, topology=dataclasses.replace(
            fit.topology, intra_node=slow, inter_node=slow))

    monkeypatch.setattr(_calibrate, "from_telemetry", slow_link)
    ex = mlp.build(optimizer="adamw", config=CONFIG)
    ref = mlp.build(optimizer="adamw", config=CONFIG)
    db = tmp_path / "t.duckdb"
    step = meshplan.distribute(ex.step, mesh={"dp": 2}, topology=_free_link_machine(),
                               telemetry=TelemetryConfig(db=db), calibrate=2)
    with step:
        got, want = [], []
        for i in range(4):
            got.append(step(*ex.batch(i)))
            want.append(ref.step(*ex.batch(i)))
            if i == 0:
                first_plan, first_run = step.plan, step.run_id
        second_run = step.run_id
        step.sync()
    # dp sums gradients over 2 ranks, one process over the batch: float32 rounding differs
    # (tests/dist/test_distribute.py's tolerances and their reasons; parameters whose true
    # gradient is ~0, here dead ReLU units, move by AdamW's m / sqrt(v) of rounding noise:
    # measured up to 9e-6 after 4 steps; a wrong plan moves weights by ~lr = 1e-2 per step)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(ex.model.named_parameters(), ref.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=3e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")

    cal = step.calibration
    assert cal is not None and cal.replanned and cal.run_id == first_run != second_run
    assert not first_plan.fully_replicated and step.plan.fully_replicated
    assert step.plan.mesh.topology.name == f"free-link+run-{first_run}"
    assert cal.fit.compute is not None and cal.fit.compute.ops > 0
    assert cal.measured_step_s > 0 and cal.fit.topology.step_overhead_s >= 0
    # the links come from blocking probes of every kind on the mesh, not from the steps'
    # collectives (a dp step's: the gradient bucket, the loss and the vote)
    assert {k for k, *_ in cal.fit.link.kinds} == {"all_reduce", "all_gather",
                                                    "reduce_scatter", "all_to_all"}
    assert {s.nbytes for s in cal.fit.samples} >= {64 << 10, 16 << 20}
    assert "re-planned" in cal.summary()

    with Store.open(db) as store:
        ops = store.sql(f"SELECT DISTINCT step FROM ops WHERE run_id = '{first_run}' "
                        "ORDER BY step").column("step").to_pylist()
        mem = store.sql(f"SELECT step, min(tensor_peak_bytes) AS lo, max(tensor_peak_bytes) AS hi,"
                        f" max(state_bytes) AS state FROM memory WHERE run_id = '{first_run}' "
                        "GROUP BY step ORDER BY step").to_pylist()
        steps = store.sql(f"SELECT DISTINCT step FROM steps WHERE run_id = '{second_run}' "
                          "ORDER BY step").column("step").to_pylist()
        probes = store.sql(f"SELECT rank, kind, axis FROM link_probes "
                           f"WHERE run_id = '{first_run}'").to_pylist()
        # the probes are in the store: fitting the run afterwards (as ``meshplan calibrate
        # --from-telemetry`` does) finds the links the calibration used
        again = real(store, first_run, base=_free_link_machine())
    # 4 kinds x 4 sizes and one wait sample per rank, on the one axis
    assert len(probes) == 2 * (4 * 4 + 1) and {p["axis"] for p in probes} == {"dp"}
    assert sum(p["kind"] == "wait" for p in probes) == 2
    assert {p["rank"] for p in probes} == {0, 1}
    assert again.probed and again.link == cal.fit.link
    assert ops == [0, 1]                       # the calibration's steps, and only them
    # the tensor memory is counted on step 0 (sampled by ops_every), not on the fit's step 1
    assert mem[0]["lo"] is not None and mem[1]["hi"] is None
    # ... and is what the planner's memory model estimates, within the issue's +-10 %
    # (measured 348,824 bytes against 342,460 planned: the model is not an upper bound)
    assert mem[0]["state"] < mem[0]["lo"]
    assert mem[0]["hi"] == pytest.approx(first_plan.peak_memory_bytes, rel=0.10)
    assert steps == [2, 3]                     # step numbers (and random ops) carry on


def test_calibrate_needs_telemetry_and_no_fixed_plan(tmp_path) -> None:
    ex = mlp.build(config=CONFIG)
    with pytest.raises(RuntimeFailure, match="telemetry is off"):
        meshplan.distribute(ex.step, mesh={"dp": 2}, telemetry=False, calibrate=True)
    with pytest.raises(RuntimeFailure, match="at least 2"):
        meshplan.distribute(ex.step, mesh={"dp": 2}, telemetry=tmp_path / "t.duckdb",
                            calibrate=1)
    with pytest.raises(RuntimeFailure, match="drop one of them"):
        meshplan.distribute(ex.step, mesh={"dp": 2}, telemetry=tmp_path / "t.duckdb",
                            calibrate=True, plan=str(tmp_path / "plan.json"))


def test_probes_time_every_kind_and_size_on_every_axis() -> None:
    """``backends/_probe.py`` on a 2 x 2 thread mesh: one sample per axis, kind and size on
    every rank, bytes in telemetry's convention (an all-gather counts what it ends with)."""
    from meshplan.backends import ThreadMesh
    from meshplan.backends._probe import KINDS, probe_links

    sizes = (4 << 10, 64 << 10)
    got = ThreadMesh(4, timeout_s=30).run(
        lambda comm: probe_links(comm, comm.rank, (2, 2), nbytes=sizes, repeats=2, iters=2))
    for samples in got:
        assert [(p["axis"], p["kind"], p["bytes"]) for p in samples] == [
            (a, k, b) for a in (0, 1) for k in KINDS for b in sizes]
        assert all(p["group_size"] == 2 and p["seconds"] > 0 for p in samples)


def test_wait_probe_measures_every_axis() -> None:
    """``probe_wait`` on a 2 x 2 thread mesh: one ``wait`` sample per axis on every rank, a
    duration (clamped at 0, never negative), each rank having run the same collectives."""
    from meshplan.backends import ThreadMesh
    from meshplan.backends._probe import probe_wait

    got = ThreadMesh(4, timeout_s=30).run(
        lambda comm: probe_wait(comm, comm.rank, (2, 2), repeats=1, iters=2))
    for samples in got:
        assert [(p["axis"], p["kind"], p["group_size"], p["bytes"]) for p in samples] == [
            (0, "wait", 2, 4), (1, "wait", 2, 4)]
        assert all(0 <= p["seconds"] < 5 for p in samples)
