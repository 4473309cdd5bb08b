"""The telemetry store, summary and trace on hand-made Parquet segments.

Segments are written the way recorders write them (``_schema.TABLES`` schemas, the documented
``<root>/<run>/<rank-dir>/<table>-<pid>-<seq>.parquet`` layout, tmp name + ``os.replace``): two
runs of 4 ranks. Run ``r1`` (6 steps) has a known straggler -- rank 2 computes 30% slower from
step 3 on while the other ranks wait for it in the dp all-reduce -- and known collectives that
match the plan's bytes; run ``r2`` (3 steps, later) has a failure. Everything here is exact
integer arithmetic, so the checks demand equality. SQL from outside (``Store.sql``, a rank's live
query, the controller's merge) must not reach files, other databases or extensions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from meshplan._errors import TelemetryError
from meshplan.telemetry._schema import TABLES, VIEWS, segments_dir
from meshplan.telemetry._store import BOOKKEEPING, Store
from meshplan.telemetry._summary import render_summary, summary
from meshplan.telemetry._trace import CONTROLLER_PID, chrome_trace, write_trace

T0 = 1_700_000_000_000_000
COMPUTE = 10_000
PLAN = [  # value, node, seq, kind, axis, group_size, bytes, est_us
    ("w1.grad", "<state w1>", 0, "all_reduce", "dp", 2, 4000, 900.0),
    ("h", "mm2", 0, "all_gather", "tp", 2, 2000, 400.0),
]


def write_segment(root: Path, run: str, rank: int, table: str, rows: list[dict],
                  seq: int = 0, schema: pa.Schema | None = None) -> Path:
    """One finished segment, written as a recorder does (tmp name, then os.replace)."""
    folder = root / run / ("controller" if rank == -1 else f"rank-{rank:05d}")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{table}-{4242 + rank}-{seq:06d}.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema or TABLES[table]),
                   str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)
    return path


def make_run(root: Path, run: str, *, start: int, steps: int, straggler: bool,
             failure: bool = False) -> int:
    """Write run ``run``'s segments; returns the number of rows written."""
    n = 0

    def put(rank: int, table: str, rows: list[dict], seq: int = 0) -> None:
        nonlocal n
        n += len(rows)
        write_segment(root, run, rank, table, rows, seq)

    put(-1, "runs", [dict(run_id=run, start_us=start, step_name="train_step",
                          mesh='{"dp": 2, "tp": 2}', world_size=4, strategy="auto",
                          topology="cpu", plan_hash="abc", est_step_us=11_000.0,
                          est_peak_bytes=1 << 20, level="ops", host="h0", pid=1,
                          meshplan_version="0.1.0", torch_version="2.x")])
    put(-1, "plan_collectives", [dict(run_id=run, value=v, node=nd, seq=s, kind=k, axis=a,
                                      group_size=g, bytes=b, est_us=e)
                                 for v, nd, s, k, a, g, b, e in PLAN])
    put(-1, "plan_nodes", [dict(run_id=run, node="mm2", target="aten.mm.default", kind="op",
                                phase="forward", module="layer", source="train.py:3",
                                inputs="x,w", outputs="h", est_compute_us=50.0)])
    for rank in range(4):
        put(rank, "ranks", [dict(run_id=run, rank=rank, host=f"host{rank // 2}", pid=100 + rank,
                                 coords=f"dp={rank // 2},tp={rank % 2}", device="cpu",
                                 start_us=start)])
        step_rows, coll_rows = [], []
        for step in range(steps):
            slow = straggler and step >= 3
            t = start + step * 100_000
            compute = 13_000 if slow and rank == 2 else COMPUTE
            ar = 1000 + (3000 if slow and rank != 2 else 0)     # the others wait for rank 2
            colls = [("w1.grad", "<state w1>", "all_reduce", "dp", 4000, ar),
                     ("h", "mm2", "all_gather", "tp", 2000, 500)]
            for seq, (v, nd, k, a, b, d) in enumerate(colls):
                coll_rows.append(dict(run_id=run, rank=rank, step=step, seq=seq, kind=k, axis=a,
                                      group_size=2, bytes=b, start_us=t + compute + seq * 5000,
                                      dur_us=d, value=v, node=nd))
            comm = ar + 500
            step_rows.append(dict(run_id=run, rank=rank, step=step, start_us=t,
                                  dur_us=compute + comm, loss=1.0 / (step + 1), comm_us=comm,
                                  comm_bytes=6000, collectives=2))
        half = len(step_rows) // 2                    # two segments for the steps of a rank
        put(rank, "steps", step_rows[:half], 0)
        put(rank, "steps", step_rows[half:], 1)
        put(rank, "collectives", coll_rows)
        put(rank, "memory", [dict(run_id=run, rank=rank, step=s, device="cpu", state_bytes=1000,
                                  allocated_bytes=5000, peak_bytes=6000 + s)
                             for s in range(steps)])
        put(rank, "ops", [dict(run_id=run, rank=rank, step=steps - 1, seq=0, node="mm2",
                               target="aten.mm.default", start_us=start + 10, dur_us=40)])
    if failure:
        put(1, "failures", [dict(run_id=run, rank=1, time_us=start + 250_000, step=2,
                                 kind="error", error="RuntimeError: boom", source="train.py:7",
                                 traceback="Traceback ...")])
    return n


@pytest.fixture()
def db(tmp_path: Path) -> tuple[Path, int]:
    path = tmp_path / "tel" / "telemetry.duckdb"
    root = segments_dir(path)
    n = make_run(root, "r1", start=T0, steps=6, straggler=True)
    n += make_run(root, "r2", start=T0 + 10_000_000, steps=3, straggler=False, failure=True)
    return path, n


def one(store: Store, q: str) -> object:
    return store.sql(q).to_pylist()[0]


def refused(run: Callable[[str], object], tmp: Path) -> None:
    """Every way out of the sandbox (``telemetry/_sandbox.py``) fails with DuckDB's reason as a
    TelemetryError, and nothing is written."""
    for sql, why in {
        f"COPY (SELECT 1 AS x) TO '{tmp / 'x.csv'}'": "Permission Error: Cannot access file",
        "SELECT * FROM read_text('/etc/hostname')": "Permission Error: Cannot access file",
        f"ATTACH '{tmp / 'y.duckdb'}' AS y": "Permission Error: Cannot access file",
        "SET enable_external_access = true": "the configuration has been locked",
        "SET lock_configuration = false": "the configuration has been locked",
        "INSTALL httpfs": "Permission Error",
        "LOAD httpfs": "Permission Error",
    }.items():
        with pytest.raises(TelemetryError, match=why):
            run(sql)
    assert not (tmp / "x.csv").exists() and not (tmp / "y.duckdb").exists()


# ---- store ---------------------------------------------------------------------------------

def test_fresh_store_creates_folder_and_empty_tables(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "t.duckdb"
    with Store.open(path) as s:
        assert s.source == f"database {path}"
        assert s.tables() == [*TABLES, *VIEWS]
        for name in s.tables():
            assert s.sql(f"SELECT * FROM {name}").num_rows == 0
        assert s.sql("SELECT * FROM steps").schema.names == TABLES["steps"].names
    assert path.exists()


def test_ingest_counts_and_is_idempotent(db: tuple[Path, int]) -> None:
    path, n = db
    with Store.open(path, ingest=False) as s:
        r = s.ingest()
        assert (r.rows, r.skipped) == (n, ())
        assert r.segments == one(s, f"SELECT count(*) AS c FROM {BOOKKEEPING}")["c"]
        assert s.ingest().rows == 0
    with Store.open(path) as s:                       # reopening ingests nothing new
        assert s.last_ingest.rows == 0
        assert one(s, "SELECT count(*) AS c FROM steps")["c"] == 4 * 6 + 4 * 3


def test_sql_rows_per_rank_and_step(db: tuple[Path, int]) -> None:
    with Store.open(db[0]) as s:
        rows = s.sql("SELECT rank, count(*) AS steps, count(DISTINCT step) AS distinct_steps "
                     "FROM steps WHERE run_id = 'r1' GROUP BY rank ORDER BY rank").to_pylist()
        assert rows == [{"rank": r, "steps": 6, "distinct_steps": 6} for r in range(4)]
        per_step = s.sql("SELECT step, count(*) AS c FROM collectives WHERE run_id = 'r1' "
                         "GROUP BY step ORDER BY step").column("c").to_pylist()
        assert per_step == [8] * 6
        assert s.sql("SELECT DISTINCT run_id FROM steps ORDER BY 1").column(0).to_pylist() \
            == ["r1", "r2"]                           # two runs, one table


def test_collectives_vs_plan_bytes_match(db: tuple[Path, int]) -> None:
    with Store.open(db[0]) as s:
        rows = s.sql("SELECT * FROM collectives_vs_plan WHERE run_id = 'r1' ORDER BY kind")
        for r in rows.to_pylist():
            assert r["measured_bytes"] == r["predicted_bytes"]
            assert r["measured_calls"] == 4 * 6
        assert rows.column("kind").to_pylist() == ["all_gather", "all_reduce"]


def test_truncated_segment_skipped_reported_and_retried(db: tuple[Path, int]) -> None:
    path, n = db
    bad = next(segments_dir(path).glob("r2/rank-00003/collectives-*.parquet"))
    good = bad.read_bytes()
    bad.write_bytes(good[: len(good) // 2])
    with Store.open(path, ingest=False) as s:
        r = s.ingest()
        assert [p for p, _ in r.skipped] == [str(bad)]
        assert r.rows == n - 3 * 2
        bad.write_bytes(good)                         # rewritten whole: the next ingest takes it
        assert s.ingest().rows == 3 * 2


def test_segment_of_the_wrong_type_is_skipped(db: tuple[Path, int]) -> None:
    """A segment that reads but cannot be inserted (a step that is not a number) is skipped and
    reported; everything else is ingested."""
    path, n = db
    schema = pa.schema([f if f.name != "step" else pa.field("step", pa.string())
                        for f in TABLES["steps"]])
    bad = write_segment(segments_dir(path), "r3", 0, "steps", [dict(run_id="r3", rank=0,
                                                                    step="x")], schema=schema)
    with Store.open(path, ingest=False) as s:
        r = s.ingest()
        assert r.rows == n and [p for p, _ in r.skipped] == [str(bad)]
        assert "Conversion Error" in r.skipped[0][1]
        assert one(s, "SELECT count(*) AS c FROM steps WHERE run_id = 'r3'")["c"] == 0


def test_ingest_is_all_or_nothing(db: tuple[Path, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash after the rows went in but before the bookkeeping did leaves nothing behind;
    the next ingest loads everything once."""
    from meshplan.telemetry import _store

    def crash(*args: object) -> None:
        raise KeyboardInterrupt

    path, n = db
    with Store.open(path, ingest=False) as s:
        monkeypatch.setattr(_store, "_record", crash)
        with pytest.raises(KeyboardInterrupt):
            s.ingest()
        assert one(s, "SELECT (SELECT count(*) FROM steps) + (SELECT count(*) FROM runs) + "
                      f"(SELECT count(*) FROM {BOOKKEEPING}) AS c")["c"] == 0
        monkeypatch.undo()
        assert s.ingest().rows == n and s.ingest().rows == 0


def test_older_and_newer_segment_columns(tmp_path: Path) -> None:
    path = tmp_path / "t.duckdb"
    old = pa.schema([f for f in TABLES["steps"] if f.name != "loss"])
    new = TABLES["steps"].append(pa.field("future_column", pa.int64()))
    base = dict(run_id="r", rank=0, start_us=1, dur_us=2, comm_us=0, comm_bytes=0, collectives=0)
    write_segment(segments_dir(path), "r", 0, "steps", [dict(base, step=0)], 0, old)
    write_segment(segments_dir(path), "r", 0, "steps",
                  [dict(base, step=1, loss=0.5, future_column=7)], 1, new)
    with Store.open(path) as s:
        assert s.last_ingest.rows == 2
        assert s.sql("SELECT step, loss FROM steps ORDER BY step").to_pylist() == \
            [{"step": 0, "loss": None}, {"step": 1, "loss": 0.5}]


def test_outside_sql_reaches_no_file_database_or_extension(db: tuple[Path, int],
                                                           tmp_path: Path) -> None:
    """Store.sql (``meshplan telemetry sql``), a rank's live query and the controller's merge
    refuse COPY TO, read_text, ATTACH, SET and INSTALL/LOAD; ordinary queries and ingest work."""
    from meshplan.runtime._telemetry import merge_answers
    from meshplan.telemetry import Recorder

    path, n = db
    with Store.open(path) as s:
        refused(s.sql, tmp_path)
        assert one(s, "SELECT count(*) AS c FROM runs")["c"] == 2
        write_segment(segments_dir(path), "r3", 0, "steps", [dict(run_id="r3", rank=0, step=0)])
        assert s.ingest().rows == 1                   # pyarrow reads the segments, not DuckDB
    rec = Recorder(tmp_path / "rec", "r1", 0, flush_interval_s=None)
    rec.add("steps", (0, 0, 1, None, 0, 0, 0))
    refused(rec.query, tmp_path)
    assert rec.query("SELECT count(*) AS n FROM steps").to_pylist() == [{"n": 1}]
    rec.close()
    answers = pa.table({"n": [1, 2]})
    refused(lambda q: merge_answers(answers, q), tmp_path)
    assert merge_answers(answers, "SELECT sum(n) AS n FROM result").to_pylist() == [{"n": 3}]


def test_sql_error_is_telemetry_error(db: tuple[Path, int]) -> None:
    with Store.open(db[0]) as s:
        with pytest.raises(TelemetryError, match="query failed: .*no_such_table"):
            s.sql("SELECT * FROM no_such_table")


def test_corrupt_database_file(tmp_path: Path) -> None:
    path = tmp_path / "t.duckdb"
    path.write_bytes(b"not a database" * 500)
    with pytest.raises(TelemetryError, match="is not a DuckDB database"):
        Store.open(path)


def test_damaged_database_is_named_damaged_not_locked(db: tuple[Path, int]) -> None:
    """Issue 19, point 7: a block failing its checksum ("... in block at ...") was taken for
    a lock and the store silently answered from segments only; it is one clear error, and
    moving the file away rebuilds the database from the segments."""
    path, n = db
    with Store.open(path):
        pass
    data = bytearray(path.read_bytes())
    for off in range(8192 + 100, len(data), 4096):      # past the headers: every block
        data[off] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(TelemetryError, match=r"is damaged \(Corrupt database file.*move it away"):
        Store.open(path)
    path.rename(path.with_suffix(".bad"))
    with Store.open(path) as s:
        assert not s.fallback and s.last_ingest.rows == n


_HOLD = """import duckdb, sys, time
con = duckdb.connect(sys.argv[1])
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture()
def locked(tmp_path: Path):
    """Lock a database file from another process, the way a running controller would."""
    procs = []

    def lock(path: Path) -> int:
        p = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "ready"
        return p.pid

    yield lock
    for p in procs:
        p.stdin.close()
        p.wait(timeout=10)


def test_locked_database_reads_segments(db: tuple[Path, int], locked) -> None:
    path, n = db
    with Store.open(path) as s:                       # the database holds run r1 and r2
        assert s.last_ingest.rows == n
    junk = segments_dir(path) / "r2" / "rank-00000" / "steps-1-000009.parquet"
    junk.write_bytes(b"PAR1 truncated")
    pid = locked(path)
    with Store.open(path) as s:
        assert s.fallback and [p for p, _ in s.skipped] == [str(junk)]
        assert s.source == f"segments {segments_dir(path)} (database {path} locked by PID {pid})"
        assert one(s, "SELECT count(*) AS c FROM steps")["c"] == 4 * 6 + 4 * 3
        assert one(s, "SELECT count(*) AS c FROM plan_nodes")["c"] == 2
        vs = s.sql("SELECT * FROM collectives_vs_plan WHERE run_id = 'r1'").to_pylist()
        assert all(r["measured_bytes"] == r["predicted_bytes"] for r in vs)
        assert summary(s, "r1")["stragglers"][0]["rank"] == 2
        refused(s.sql, path.parent)                   # the segments' views are sandboxed too
        with pytest.raises(TelemetryError, match="cannot ingest"):
            s.ingest()


def test_locked_database_without_segments(tmp_path: Path, locked) -> None:
    path = tmp_path / "t.duckdb"
    pid = locked(path)
    with pytest.raises(TelemetryError, match=f"{path} is locked by PID {pid}.*close that process"):
        Store.open(path)


# ---- summary -------------------------------------------------------------------------------

def test_summary_straggler_comm_share_and_plan(db: tuple[Path, int]) -> None:
    with Store.open(db[0]) as s:
        d = summary(s, "r1")
        json.dumps(d, allow_nan=False)                # JSON-safe
        render_summary(d)
        latest = summary(s)
    ranks = {r["rank"]: r for r in d["ranks"]}
    assert sorted(ranks) == [0, 1, 2, 3] and all(r["steps"] == 6 for r in ranks.values())
    assert ranks[0]["compute_p50_us"] == COMPUTE
    assert ranks[2]["compute_p50_us"] == (COMPUTE + 13_000) / 2
    # rank 0: comm 1500 x3 + 4500 x3 over dur 11500 x3 + 14500 x3
    assert ranks[0]["comm_share"] == pytest.approx(18_000 / 78_000)
    assert ranks[2]["comm_share"] == pytest.approx(9_000 / (3 * 11_500 + 3 * 14_500))
    assert ranks[1]["host"] == "host0" and ranks[1]["coords"] == "dp=0,tp=1"
    [st] = d["stragglers"]
    assert (st["rank"], st["since_step"]) == (2, 3)
    assert st["slower_by"] == pytest.approx(0.15) and st["slower_since"] == pytest.approx(0.30)
    w = st["others_wait_in"]
    assert (w["kind"], w["axis"], w["node"], w["mean_us"]) == ("all_reduce", "dp", "<state w1>",
                                                              4000)
    coll = {(c["kind"], c["axis"]): c for c in d["collectives"]}
    ar = coll[("all_reduce", "dp")]
    assert (ar["predicted_bytes"], ar["measured_bytes"], ar["calls_per_step"]) == (4000, 4000, 1)
    assert (ar["predicted_us"], ar["measured_us"]) == (900.0, (4 * 3 * 1000 + 3 * 3 * 4000 + 3 * 1000) / 24)
    assert d["failures"] == [] and d["run"]["mesh"] == '{"dp": 2, "tp": 2}'
    assert latest["run_id"] == "r2" and latest["stragglers"] == []
    assert latest["failures"][0]["error"] == "RuntimeError: boom"


def test_summary_without_runs_rows_and_unknown_run(tmp_path: Path) -> None:
    path = tmp_path / "t.duckdb"
    for run, start in (("a", 5), ("b", 9)):
        write_segment(segments_dir(path), run, 0, "steps",
                      [dict(run_id=run, rank=0, step=0, start_us=start, dur_us=3, comm_us=1)])
    with Store.open(path) as s:
        assert summary(s)["run_id"] == "b"
        with pytest.raises(TelemetryError, match="run 'zz' is not in .*known runs: a, b"):
            summary(s, "zz")
    with Store.open(tmp_path / "empty.duckdb") as s, pytest.raises(TelemetryError, match="no runs"):
        summary(s)


# ---- trace ---------------------------------------------------------------------------------

def check_trace(trace: dict) -> None:
    """The structure Perfetto and chrome://tracing need."""
    assert set(trace) >= {"traceEvents", "displayTimeUnit"}
    assert trace["displayTimeUnit"] in ("ms", "ns")
    for e in trace["traceEvents"]:
        assert isinstance(e["name"], str) and e["ph"] in ("X", "i", "M"), e
        for key in ("ts", "pid", "tid"):
            assert isinstance(e[key], int) and not isinstance(e[key], bool), (key, e)
        if e["ph"] == "X":
            assert isinstance(e["dur"], int) and e["dur"] >= 0 and e["ts"] >= 0, e
        if e["ph"] == "i":
            assert e["s"] in ("g", "p", "t"), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "process_sort_index"), e
            assert isinstance(e["args"], dict) and len(e["args"]) == 1, e
        assert isinstance(e.get("args", {}), dict)
    json.dumps(trace, allow_nan=False)


def test_trace_structure(db: tuple[Path, int], tmp_path: Path) -> None:
    with Store.open(db[0]) as s:
        t = chrome_trace(s, "r1")
        n = write_trace(s, tmp_path / "trace.json")  # the latest run: r2, with its failure
    check_trace(t)
    ev = t["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in ev if e["name"] == "process_name"}
    assert names == {(r, f"rank {r} (host{r // 2})") for r in range(4)}
    threads = {(e["pid"], e["tid"], e["args"]["name"]) for e in ev if e["name"] == "thread_name"}
    assert threads == {(r, tid, name) for r in range(4)
                       for tid, name in ((0, "steps"), (1, "collectives"), (2, "ops"))}
    x = [e for e in ev if e["ph"] == "X"]
    assert sum(e["tid"] == 0 for e in x) == 24 and sum(e["tid"] == 1 for e in x) == 48
    assert min(e["ts"] for e in x) == 0
    ar = next(e for e in x if e["tid"] == 1 and e["pid"] == 0 and e["args"]["step"] == 4)
    assert ar["args"]["bytes"] == 4000 and ar["args"]["axis"] == "dp" and ar["dur"] == 4000
    written = json.loads((tmp_path / "trace.json").read_text())
    check_trace(written)
    assert len(written["traceEvents"]) == n and written["otherData"]["run_id"] == "r2"
    [fail] = [e for e in written["traceEvents"] if e["ph"] == "i"]
    assert fail["pid"] == 1 and fail["args"]["error"] == "RuntimeError: boom"
    assert CONTROLLER_PID not in {e["pid"] for e in written["traceEvents"]}
