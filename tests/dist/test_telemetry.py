"""Telemetry of real runs: what the SQL store says happened is what happened.

A GPT-style step on 4 local processes (dp=2 x tp=2, Megatron plan) records into a fresh store;
the answers are checked against what the controller saw (losses, collective calls per rank) and
against the plan (bytes per collective must equal the plan's exactly: both count the same
buffers). Then the failure paths: a killed rank keeps its journaled rows and gets a ``failures``
row; a raising rank records its own error with the user's line; a stalled worker is reported
missing by the live fan-out query and the run goes on.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

import meshplan
from meshplan.examples import gpt, mlp
from meshplan.telemetry import Store, TelemetryConfig

STEPS = 3


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    """One 4-rank GPT run with level ``ops`` (every op timed on every other step)."""
    db = tmp_path_factory.mktemp("tel") / "t.duckdb"
    ex = gpt.build(optimizer="adamw", clip=1.0)
    cfg = TelemetryConfig(db=db, level="ops", ops_every=2)
    step = meshplan.distribute(ex.step, mesh={"dp": 2, "tp": 2}, strategy="megatron_tp",
                               telemetry=cfg)
    losses, comm = [], []
    with step:
        for i in range(STEPS):
            losses.append(float(step(*ex.batch(i))))
            comm.append([len(c) for c in step.last_comm])
        live = step.query("SELECT rank, count(*) AS n FROM steps GROUP BY rank ORDER BY rank")
        escape = step.query(f"COPY (SELECT 1 AS x) TO '{db.parent / 'live.csv'}'")
        run_id = step.run_id
        plan = step.plan
    return {"db": db, "losses": losses, "comm": comm, "live": live, "escape": escape,
            "run_id": run_id, "plan": plan}


def _rows(db, sql: str) -> list[dict]:
    with Store.open(db) as store:
        return store.sql(sql).to_pylist()


@pytest.mark.timeout(240)
def test_sql_answers_match_the_run(gpt_run) -> None:
    db, run_id = gpt_run["db"], gpt_run["run_id"]
    runs = _rows(db, "SELECT * FROM runs")
    assert [r["run_id"] for r in runs] == [run_id]
    assert json.loads(runs[0]["mesh"]) == {"dp": 2, "tp": 2} and runs[0]["world_size"] == 4
    assert runs[0]["plan_hash"] == gpt_run["plan"].graph_hash and runs[0]["level"] == "ops"
    ranks = _rows(db, "SELECT rank, coords FROM ranks ORDER BY rank")
    assert [(r["rank"], r["coords"]) for r in ranks] == [
        (0, "dp=0,tp=0"), (1, "dp=0,tp=1"), (2, "dp=1,tp=0"), (3, "dp=1,tp=1")]
    # one steps row per rank per step, each with the loss the controller returned
    steps = _rows(db, "SELECT rank, step, loss, collectives, dur_us, comm_us FROM steps "
                      "WHERE rank >= 0 ORDER BY step, rank")
    assert [(s["step"], s["rank"]) for s in steps] == [(i, r) for i in range(STEPS)
                                                       for r in range(4)]
    for s in steps:
        assert s["loss"] == pytest.approx(gpt_run["losses"][s["step"]], rel=0, abs=0)
        assert s["collectives"] == gpt_run["comm"][s["step"]][s["rank"]]
        assert 0 <= s["comm_us"] <= s["dur_us"]
    # collectives rows per rank and step = the calls the communicator made
    calls = _rows(db, "SELECT rank, step, count(*) AS n FROM collectives GROUP BY ALL "
                      "ORDER BY step, rank")
    assert [c["n"] for c in calls] == [n for per_step in gpt_run["comm"] for n in per_step]
    # the controller's own view of each step
    ctl = _rows(db, "SELECT step, loss FROM steps WHERE rank = -1 ORDER BY step")
    assert [c["loss"] for c in ctl] == gpt_run["losses"]


@pytest.mark.timeout(240)
def test_bytes_per_collective_equal_the_plan(gpt_run) -> None:
    rows = _rows(gpt_run["db"], "SELECT * FROM collectives_vs_plan WHERE measured_calls > 0")
    assert rows
    for r in rows:
        assert r["measured_bytes"] == r["predicted_bytes"], r
        assert r["measured_calls"] == 4 * STEPS, r       # every rank runs every collective
    unplanned = _rows(gpt_run["db"], """
        SELECT c.* FROM collectives c ANTI JOIN plan_collectives p
          ON c.run_id = p.run_id AND c.value = p.value AND c.node = p.node
         AND c.kind = p.kind AND c.axis = p.axis""")
    assert unplanned == []


@pytest.mark.timeout(240)
def test_ops_are_sampled_and_the_live_query_merges_every_rank(gpt_run) -> None:
    ops = _rows(gpt_run["db"], "SELECT DISTINCT step FROM ops ORDER BY step")
    assert [o["step"] for o in ops] == [s for s in range(STEPS) if s % 2 == 0]
    per_node = _rows(gpt_run["db"], "SELECT count(*) AS n FROM ops_vs_plan "
                                    "WHERE measured_calls > 0")
    assert per_node[0]["n"] > 50
    live = gpt_run["live"]
    assert live.complete
    assert live.table.to_pylist() == [{"rank": r, "n": STEPS} for r in range(4)]
    # a live query cannot write files (telemetry/_sandbox.py): every rank refuses COPY TO
    escape = gpt_run["escape"]
    assert sorted(escape.errors) == [0, 1, 2, 3] and not escape.missing, escape
    assert all("Permission Error" in m for m in escape.errors.values()), escape.errors
    assert not (gpt_run["db"].parent / "live.csv").exists()


@pytest.mark.timeout(240)
def test_the_trace_file_is_chrome_trace_json(gpt_run, tmp_path) -> None:
    from meshplan.telemetry import write_trace

    out = tmp_path / "trace.json"
    with Store.open(gpt_run["db"]) as store:
        write_trace(store, out)
    doc = json.loads(out.read_text())
    events = doc["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} >= {0, 1, 2, 3}
    for e in events:
        assert {"name", "ph", "pid"} <= set(e), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["ts"], (int, float))


@pytest.mark.timeout(180)
def test_a_killed_rank_leaves_its_journaled_rows_and_a_failure(tmp_path) -> None:
    """A rank SIGKILLed between steps, long before its next flush (the interval is 600 s):
    the rows of its steps were appended to its journal at each step's end, and the
    controller turns the journal into segments at shutdown (``recover_journals``)."""
    db = tmp_path / "k.duckdb"
    ex = mlp.build(optimizer="adamw")
    cfg = TelemetryConfig(db=db, flush_interval_s=600)
    step = meshplan.distribute(ex.step, mesh={"dp": 2}, strategy="dp", telemetry=cfg,
                               timeout_s=60, fault_tolerance=False)     # the run stops
    with step:
        step(*ex.batch(0))
        step(*ex.batch(1))
        time.sleep(0.3)                 # the journal thread writes step 1's rows (~ms)
        os.kill(step._workers.pids[1], signal.SIGKILL)
        with pytest.raises(meshplan.RuntimeFailure, match="rank 1"):
            step(*ex.batch(2))
    got = _rows(db, "SELECT step FROM steps WHERE rank = 1 ORDER BY step")
    assert [g["step"] for g in got] == [0, 1]
    fail = _rows(db, "SELECT rank, step, kind, error FROM failures ORDER BY kind")
    # the controller's row for the dead rank; rank 0 may also record its own error (the
    # collective it was in lost its peer), which is what happened to it
    dead = [f for f in fail if f["kind"] == "exit"]
    assert [(f["rank"], f["step"]) for f in dead] == [(1, 2)] and "rank 1" in dead[0]["error"]
    assert all((f["rank"], f["step"], f["kind"]) == (0, 2, "error") for f in fail
               if f["kind"] != "exit")


@pytest.mark.timeout(180)
def test_a_raising_rank_records_its_error_and_line(tmp_path) -> None:
    db = tmp_path / "e.duckdb"
    ex = mlp.build(optimizer="adamw")
    step = meshplan.distribute(ex.step, mesh={"dp": 2}, strategy="dp", telemetry=db,
                               fault_tolerance=False)    # its snapshot would refuse the piece
    with step:
        step(*ex.batch(0))
        # a 3x3 piece of fc1.weight on every rank, past load_state_dict's shape check: the
        # next step fails on the ranks
        name = next(n.target for n in step.plan.graph.inputs if n.target.endswith("fc1.weight"))
        step._send_state("set_state", {name: torch.zeros(3, 3)}, lambda r, names: {"names": names})
        with pytest.raises(meshplan.RuntimeFailure):
            step(*ex.batch(1))
    rows = _rows(db, "SELECT rank, step, kind, source, traceback FROM failures ORDER BY rank")
    mine = [r for r in rows if r["rank"] >= 0 and r["kind"] == "error"]
    assert mine and all(r["step"] == 1 for r in mine)
    assert any("mlp.py" in (r["source"] or "") for r in mine), rows
    assert any("Traceback" in (r["traceback"] or "") for r in mine)


@pytest.mark.timeout(180)
def test_a_stalled_worker_is_reported_missing_and_the_run_goes_on(tmp_path) -> None:
    ex = mlp.build(optimizer="adamw")
    step = meshplan.distribute(ex.step, mesh={"dp": 2}, strategy="dp",
                               telemetry=tmp_path / "s.duckdb", timeout_s=60)
    with step:
        step(*ex.batch(0))
        pid = step._workers.pids[1]
        os.kill(pid, signal.SIGSTOP)
        try:
            res = step.query("SELECT rank, count(*) AS n FROM steps GROUP BY rank", timeout_s=2)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert res.missing == (1,) and not res.errors
        assert res.table.to_pylist() == [{"rank": 0, "n": 1}]
        step(*ex.batch(1))                  # the late answer is dropped, not taken for this
        res = step.query("SELECT rank, count(*) AS n FROM steps GROUP BY rank ORDER BY rank")
        assert res.complete and res.table.to_pylist() == [{"rank": 0, "n": 2},
                                                          {"rank": 1, "n": 2}]
        bad = step.query("SELECT * FROM no_such_table")
        assert set(bad.errors) == {0, 1} and "no_such_table" in bad.errors[0]
        step(*ex.batch(2))                  # a failed query is not a failed run


@pytest.mark.timeout(120)
def test_telemetry_off_records_nothing(tmp_path) -> None:
    ex = mlp.build(optimizer="adamw")
    step = meshplan.distribute(ex.step, mesh={"dp": 2}, strategy="dp", telemetry=False)
    with step:
        step(*ex.batch(0))
        with pytest.raises(meshplan.RuntimeFailure, match="telemetry is off"):
            step.query("SELECT 1")
    assert step.telemetry is None


@pytest.mark.timeout(240)
def test_the_summary_of_a_real_run(gpt_run) -> None:
    """Per-rank rows are the mesh's ranks (the controller is reported apart), and the plan
    vs measured table counts each rank's calls per step as the communicator made them."""
    from meshplan.telemetry import summary

    with Store.open(gpt_run["db"]) as store:
        d = summary(store)
    assert d["run_id"] == gpt_run["run_id"]
    assert [r["rank"] for r in d["ranks"]] == [0, 1, 2, 3]
    assert all(r["steps"] == STEPS for r in d["ranks"])
    assert d["controller"]["steps"] == STEPS
    calls = sum(row["calls_per_step"] for row in d["collectives"])
    assert calls == pytest.approx(sum(gpt_run["comm"][0]) / 4)
    assert d["failures"] == []
