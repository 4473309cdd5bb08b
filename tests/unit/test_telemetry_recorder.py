"""The per-rank recorder: rows in, Parquet segments out, live SQL over recent rows; and how
``distribute(telemetry=...)`` reads its argument and the environment."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from meshplan._errors import TelemetryError
from meshplan.telemetry import Level, Recorder, TelemetryConfig


def test_rows_become_segments_with_run_and_rank_filled_in(tmp_path) -> None:
    rec = Recorder(tmp_path, "r1", 3, flush_interval_s=None)
    rec.add("steps", (0, 100, 50, 1.5, 10, 1024, 2))
    rec.add("failures", (5, 0, "exit", "rank 1 died", None, None), rank=1)
    assert rec.flush() == 2
    rec.add("steps", (1, 200, 60, None, 12, 1024, 2))
    rec.close()
    files = sorted(p.name for p in (tmp_path / "r1" / "rank-00003").iterdir())
    assert [f.split("-")[0] for f in files] == ["failures", "steps", "steps"]
    assert not any(f.startswith(".") for f in files)          # no temporary left behind
    steps = pq.read_table([tmp_path / "r1" / "rank-00003" / f for f in files
                           if f.startswith("steps")][0]).to_pylist()
    assert steps == [{"run_id": "r1", "rank": 3, "step": 0, "start_us": 100, "dur_us": 50,
                      "loss": 1.5, "comm_us": 10, "comm_bytes": 1024, "collectives": 2}]
    failure = pq.read_table(next((tmp_path / "r1" / "rank-00003").glob("failures-*"))).to_pylist()
    assert failure[0]["rank"] == 1                              # about another rank


def test_live_queries_see_flushed_and_pending_rows_up_to_the_limit(tmp_path) -> None:
    rec = Recorder(tmp_path, "r1", 0, flush_interval_s=None, live_rows=3)
    for step in range(5):
        rec.add("steps", (step, 0, 10 * step, None, 0, 0, 0))
        rec.flush()
    rec.add("steps", (5, 0, 50, None, 0, 0, 0))                # pending, not flushed
    got = rec.query("SELECT step FROM steps ORDER BY step").column("step").to_pylist()
    assert got[-1] == 5 and len(got) >= 3 and got == sorted(got)
    assert rec.query("SELECT count(*) AS n FROM collectives_vs_plan").to_pylist() == [{"n": 0}]
    with pytest.raises(TelemetryError, match="nosuch"):
        rec.query("SELECT * FROM nosuch")
    rec.close()


def test_a_failed_write_keeps_the_rows_for_the_next_flush(tmp_path) -> None:
    rec = Recorder(tmp_path, "r1", 0, flush_interval_s=None)
    rec.add("steps", (0, 0, 1, None, 0, 0, 0))
    rec.dir.rmdir()
    rec.dir.write_text("in the way")          # the folder is gone: every write fails
    assert rec.flush() == 0
    rec.dir.unlink()
    rec.dir.mkdir()
    assert rec.flush() == 1
    rec.close()
    assert len(list(rec.dir.glob("steps-*.parquet"))) == 1


def test_the_background_thread_flushes_on_its_interval(tmp_path) -> None:
    import time

    rec = Recorder(tmp_path, "r1", 0, flush_interval_s=0.05)
    rec.add("steps", (0, 0, 1, None, 0, 0, 0))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not list(rec.dir.glob("steps-*.parquet")):
        time.sleep(0.02)
    assert list(rec.dir.glob("steps-*.parquet"))
    rec.close()


def test_what_telemetry_arguments_mean(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MESHPLAN_TELEMETRY_LEVEL", raising=False)
    monkeypatch.setenv("MESHPLAN_TELEMETRY", str(tmp_path / "env.duckdb"))
    assert TelemetryConfig.resolve(None).db == tmp_path / "env.duckdb"
    assert TelemetryConfig.resolve(None).level is Level.COLLECTIVES
    assert TelemetryConfig.resolve(False) is None
    assert TelemetryConfig.resolve("off") is None
    assert TelemetryConfig.resolve(tmp_path / "x.duckdb").db == tmp_path / "x.duckdb"
    assert TelemetryConfig.resolve(TelemetryConfig(level="off")) is None
    cfg = TelemetryConfig(db=tmp_path / "c.duckdb", level="ops", ops_every=3)
    assert TelemetryConfig.from_json(cfg.to_json()) == cfg
    assert cfg.segments == tmp_path / "c.segments"
    monkeypatch.setenv("MESHPLAN_TELEMETRY", "off")
    assert TelemetryConfig.resolve(None) is None
    monkeypatch.setenv("MESHPLAN_TELEMETRY", str(tmp_path / "env.duckdb"))
    monkeypatch.setenv("MESHPLAN_TELEMETRY_LEVEL", "steps")
    assert TelemetryConfig.resolve(None).level is Level.STEPS
    with pytest.raises(TelemetryError, match="unknown telemetry level"):
        TelemetryConfig(level="loud")
    with pytest.raises(TelemetryError, match="not understood"):
        TelemetryConfig.resolve(42)
    with pytest.raises(TelemetryError, match="ops_every"):
        TelemetryConfig(ops_every=0)


def test_step_comm_time_counts_overlapping_collectives_once() -> None:
    """``steps.comm_us`` is the time a collective was in flight: two bucketed all-reduces that
    overlap count once (their sum exceeded the step's duration once on a loaded machine)."""
    from meshplan.backends import CommRecord
    from meshplan.runtime._telemetry import _busy_us

    def rec(start: float, dur: float) -> CommRecord:
        return CommRecord("all_reduce", (0, 1), 4, start, dur)

    assert _busy_us([]) == 0
    assert _busy_us([rec(10.0, 0.002), rec(10.001, 0.002), rec(10.010, 0.001)]) == 4000
    assert _busy_us([rec(10.0, 0.005), rec(10.001, 0.001)]) == 5000      # one inside another
    assert _busy_us([rec(10.002, 0.001), rec(10.0, 0.001)]) == 2000      # any order


def test_segments_of_ranks_on_a_disk_the_controller_does_not_see_are_shipped(tmp_path) -> None:
    """``runtime._telemetry.SegmentShipper``: a rank whose marker the controller finds at its
    own path shares the disk (marker removed, nothing shipped); one whose marker it does not
    find is fetched, and what it sends lands as the Recorder would have written it."""
    import torch

    from meshplan.runtime._telemetry import SegmentShipper
    from meshplan.telemetry import Store

    config = TelemetryConfig(db=tmp_path / "ctl" / "t.duckdb")
    here = Recorder(config.segments, "run1", 0, flush_interval_s=None)
    (here.dir / ".here-00112233445566ff").touch()
    far = Recorder(tmp_path / "other-host", "run1", 1, flush_interval_s=None, journal=True)
    far.add("ranks", ("hostB", 1, "dp=1", "cpu", 0))
    far.flush()                       # a journaling rank's names: <table>-<pid>-j<n>-<seq>
    shipper = SegmentShipper(config, "run1", [".here-00112233445566ff", ".here-aabbccddeeff0011"])
    assert shipper.ranks == [1]
    assert not (here.dir / ".here-00112233445566ff").exists()
    files = sorted(far.dir.glob("*.parquet"))
    shipper.write(1, [f.name for f in files],
                  [torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8) for f in files])
    with Store.open(config.db) as store:
        assert store.sql("SELECT host FROM ranks WHERE rank = 1").column(0).to_pylist() == \
            ["hostB"]
    with pytest.raises(ValueError, match="shipped a telemetry segment named '../x.parquet'"):
        shipper.write(1, ["../x.parquet"], [torch.zeros(1, dtype=torch.uint8)])


def test_a_killed_process_keeps_its_journaled_rows_and_none_twice(tmp_path) -> None:
    """``journal=True`` (a rank's recorder): a process SIGKILLed (as mpiexec ends every rank
    once one dies) before its next flush keeps the rows journaled at its step ends;
    ``recover_journals`` makes segments of them once, skipping a table whose segment of that
    journal was written (a flush the kill cut short before it removed its journal);
    ``gone_here`` (``meshplan telemetry ingest``) leaves a live process's journal alone."""
    import os
    import signal
    import subprocess
    import sys

    from meshplan.telemetry._recorder import recover_journals

    script = (
        "import os, signal, sys\n"
        "from meshplan.telemetry import Recorder\n"
        "rec = Recorder(sys.argv[1], 'r1', 2, flush_interval_s=None, journal=True)\n"
        "for step in range(3):\n"
        "    rec.add('steps', (step, 0, 10, 0.5, 0, 0, 0))\n"
        "rec.flush()\n"                        # steps 0-2 in a segment, journal 0 removed
        "for step in range(3, 5):\n"
        "    rec.add('steps', (step, 0, 10, 0.5, 0, 0, 0))\n"
        "    rec.journal()\n"                  # a step end
        "rec.add('steps', (5, 0, 10, 0.5, 0, 0, 0))\n"     # the step in flight: not journaled
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], timeout=60)
    assert done.returncode == -signal.SIGKILL
    folder = tmp_path / "r1" / "rank-00002"
    assert len(list(folder.glob(".journal-*.jsonl"))) == 1
    assert recover_journals(tmp_path / "r1", gone_here=True) == 2     # its process is gone
    assert recover_journals(tmp_path / "r1") == 0                 # removed: not twice
    steps = sorted(r["step"] for f in folder.glob("steps-*.parquet")
                   for r in pq.read_table(f).to_pylist())
    assert steps == [0, 1, 2, 3, 4]
    # a flush that wrote its steps segment, then died before removing its journal
    rec = Recorder(tmp_path, "r2", 0, flush_interval_s=None, journal=True)
    rec.add("steps", (0, 0, 10, None, 0, 0, 0))
    rec.add("failures", (5, 0, "exit", "x", None, None))
    rec.journal()
    (rec.dir / f"steps-{os.getpid()}-j000000-000000.parquet").write_bytes(b"")
    assert recover_journals(tmp_path / "r2", gone_here=True) == 0  # this process: alive
    assert recover_journals(tmp_path / "r2") == 1                  # the failures row only
    rec.close()


def test_a_rank_started_again_recovers_its_predecessors_journal(tmp_path) -> None:
    """Fault tolerance starts a killed rank again in the same folder: the new process turns
    the journal its predecessor left there into segments (which then ship with its own when
    the controller does not see this disk), and leaves other ranks' folders alone."""
    import signal
    import subprocess
    import sys

    from meshplan.telemetry._recorder import recover_journals

    script = ("import os, signal, sys\nfrom meshplan.telemetry import Recorder\n"
              "for rank in (0, 1):\n"
              "    rec = Recorder(sys.argv[1], 'r1', rank, flush_interval_s=None, journal=True)\n"
              "    rec.add('steps', (7, 0, 10, 0.5, 0, 0, 0))\n"
              "    rec.journal()\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], timeout=60)
    assert done.returncode == -signal.SIGKILL
    assert recover_journals(tmp_path / "r1", gone_here=True, ranks="rank-00001") == 1
    assert list((tmp_path / "r1" / "rank-00001").glob("steps-*-journal.parquet"))
    assert list((tmp_path / "r1" / "rank-00000").glob(".journal-*"))     # not its folder
