"""``meshplan telemetry ingest | sql | summary | trace`` as a user runs them (``python -m meshplan``
in fresh processes) on hand-made segments of one run with 2 ranks, 4 steps; rank 1
computes 50% slower. Bad inputs (a SQL error, an unknown run, no database, a folder that does not
exist) go through ``cli.main`` in this process and must give ONE stderr line and exit 1.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from meshplan.cli import main
from meshplan.telemetry._schema import TABLES, segments_dir

TIMEOUT = 120


def write_segment(root: Path, run: str, rank: int, table: str, rows: list[dict]) -> None:
    folder = root / run / ("controller" if rank == -1 else f"rank-{rank:05d}")
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{table}.tmp"
    pq.write_table(pa.Table.from_pylist(rows, schema=TABLES[table]), tmp)
    os.replace(tmp, folder / f"{table}-{77 + rank}-000000.parquet")


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tel") / "telemetry.duckdb"
    root = segments_dir(path)
    write_segment(root, "run-a", -1, "runs", [dict(run_id="run-a", start_us=1, mesh='{"dp": 2}',
                                                   world_size=2, level="collectives")])
    write_segment(root, "run-a", -1, "plan_collectives",
                  [dict(run_id="run-a", value="g", node="<state w>", seq=0, kind="all_reduce",
                        axis="dp", group_size=2, bytes=1024, est_us=10.0)])
    for rank in range(2):
        compute = 150 if rank else 100
        write_segment(root, "run-a", rank, "steps", [
            dict(run_id="run-a", rank=rank, step=s, start_us=1000 * s, dur_us=compute + 20,
                 loss=float("nan") if s == 0 else 1.0, comm_us=20, comm_bytes=1024,
                 collectives=1) for s in range(4)])
        write_segment(root, "run-a", rank, "collectives", [
            dict(run_id="run-a", rank=rank, step=s, seq=0, kind="all_reduce", axis="dp",
                 group_size=2, bytes=1024, start_us=1000 * s + compute, dur_us=20, value="g",
                 node="<state w>") for s in range(4)])
    return path


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "meshplan", "telemetry", *args], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT, check=False)


def test_the_four_commands(db: Path, tmp_path: Path) -> None:
    """Each subcommand once in a fresh process, one after another (DuckDB's one-process lock
    would otherwise send some of them to the segments)."""
    ingest = cli("ingest", "--db", str(db))
    assert ingest.returncode == 0, ingest.stderr
    assert ingest.stdout.startswith("ingested 18 rows from 6 segments")
    trace = tmp_path / "trace.json"
    out = {name: cli(*args) for name, args in {
        "json": ("sql", "SELECT rank, count(*) AS n, min(loss) AS loss FROM steps "
                 "GROUP BY rank ORDER BY rank", "--db", str(db), "--json"),
        "summary": ("summary", "--db", str(db)),
        "trace": ("trace", "--out", str(trace), "--db", str(db)),
        "ingest": ("ingest", "--db", str(db), "--json"),      # nothing new the second time
    }.items()}
    for name, p in out.items():
        assert p.returncode == 0 and not p.stderr, (name, p.stderr)
    assert json.loads(out["json"].stdout) == [{"rank": 0, "n": 4, "loss": 1.0},
                                              {"rank": 1, "n": 4, "loss": 1.0}]
    assert "straggler: rank 1" in out["summary"].stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 16
    assert "wrote 24 trace events" in out["trace"].stdout
    assert json.loads(out["ingest"].stdout) == {"db": str(db), "rows": 0, "segments": 0,
                                                "recovered_rows": 0, "skipped": []}


def test_outputs_in_process(db: Path, capsys: pytest.CaptureFixture) -> None:
    def run(*args: str) -> str:
        assert main(["telemetry", *args, "--db", str(db)]) == 0
        captured = capsys.readouterr()
        assert not captured.err, captured.err
        return captured.out

    assert json.loads(run("sql", "SELECT loss FROM steps WHERE step = 0 LIMIT 1", "--json")) \
        == [{"loss": None}]                                       # NaN is not JSON
    table = run("sql", "SELECT kind, sum(bytes) AS b FROM collectives GROUP BY kind")
    assert "all_reduce" in table and "8192" in table and "1 rows" in table
    d = json.loads(run("summary", "--run", "run-a", "--json"))
    assert d["run_id"] == "run-a" and [s["rank"] for s in d["stragglers"]] == [1]
    assert d["collectives"][0]["measured_bytes"] == d["collectives"][0]["predicted_bytes"] == 1024
    assert d["ranks"][0]["comm_share"] == 20 / 120


@pytest.mark.parametrize("args, message", [
    (["sql", "SELEC 1"], "TelemetryError: query failed: Parser Error"),
    (["sql", "SELECT * FROM read_text('/etc/hostname')"],
     "TelemetryError: query failed: Permission Error: Cannot access file"),
    (["summary", "--run", "nope"], "TelemetryError: run 'nope' is not in"),
    (["trace", "--out", "/no/such/folder/t.json"], "folder /no/such/folder does not exist"),
])
def test_bad_input_is_one_line(db: Path, args: list[str], message: str,
                               capsys: pytest.CaptureFixture) -> None:
    assert main(["telemetry", *args, "--db", str(db)]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_no_database(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "none.duckdb"
    assert main(["telemetry", "sql", "SELECT 1", "--db", str(missing)]) == 1
    err = capsys.readouterr().err
    assert "no telemetry database at" in err and len(err.strip().splitlines()) == 1
    assert not missing.exists()


def test_locked_database_reads_the_segments(db: Path, capsys: pytest.CaptureFixture,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """While another process holds the database, queries read the segments and say so on
    stderr; ingest cannot, and says who holds the lock."""
    hold = subprocess.Popen([sys.executable, "-c", "import duckdb, sys; c = duckdb.connect("
                             "sys.argv[1]); print('ready', flush=True); sys.stdin.read()",
                             str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert hold.stdout.readline().strip() == "ready"
        assert main(["telemetry", "sql", "SELECT count(*) AS n FROM steps", "--json",
                     "--db", str(db)]) == 0
        out = capsys.readouterr()
        assert json.loads(out.out) == [{"n": 8}]
        assert out.err.strip() == (f"reading segments {segments_dir(db)} (database {db} locked "
                                   f"by PID {hold.pid})")
        assert main(["telemetry", "ingest", "--db", str(db)]) == 1
        err = capsys.readouterr().err
        assert "cannot ingest" in err and f"PID {hold.pid}" in err and err.count("\n") == 1
        # a run that ends meanwhile (its controller's last ingest) says where its rows stay
        from meshplan.runtime._telemetry import ingest
        from meshplan.telemetry import TelemetryConfig

        with caplog.at_level(logging.WARNING):
            ingest(TelemetryConfig(db=db))
        assert "stays in its segments" in caplog.text and f"PID {hold.pid}" in caplog.text
        assert "reading segments" not in caplog.text
    finally:
        hold.stdin.close()
        hold.wait(timeout=10)
