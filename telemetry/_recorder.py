"""The per-rank recorder: rows buffered in memory, flushed as Parquet segments, queryable live.

One ``Recorder`` per process of a run (every rank, and the controller as rank ``-1``). ``add``
appends a row (a tuple in the table's column order, see ``_schema.TABLES``) under a lock: a
list append, cheap enough for every collective of every step. A daemon thread flushes what is
pending every ``flush_interval_s`` as one Parquet segment per table,
``<root>/<run_id>/<rank-dir>/<table>-<pid>-<seq>.parquet``, written under a temporary name and
renamed into place, so a reader never sees half a file and a rank that crashes keeps everything
flushed before it. ``flush()`` is also called at ``close()``, at interpreter exit and by the
runtime right after a failure.

A process killed by SIGKILL (or by mpiexec, which SIGKILLs every rank once one dies) runs none
of that. With ``journal=True`` (the ranks') the rows added since the last flush are also
appended, at every ``journal_soon()`` (a rank's step end) from a thread of their own, as JSON
lines to ``.journal-<host>-<pid>-<gen>.jsonl`` in the same folder: the kernel keeps what was
written when the process dies. Each flush starts the next journal and removes the previous once its
rows are in segments, whose names carry the journal's number
(``<table>-<pid>-j<gen>-<seq>.parquet``); ``recover_journals`` turns the journals a dead
process left into segments, skipping the tables whose segments of that journal exist. What
is lost is only what was added after the last journal write (the step in flight). The
controller calls it for its run at shutdown; ``meshplan telemetry ingest`` for every run, on
the journals of this host whose process is gone (a controller that was killed); and a rank
started again (fault tolerance) on its own folder, for its predecessor's journal there, so
that a rank on a disk the controller does not see ships the rows with its segments.

The most recent rows (``live_rows`` per table, flushed or not) stay in memory as Arrow tables,
so ``query(sql)`` answers over this rank's recent events without touching disk: the runtime's
live fan-out query sends the same SQL to every worker and merges the answers.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import re
import socket
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from .._errors import TelemetryError
from ._schema import (
    DEFAULT_LEVEL,
    ENV_DB,
    ENV_LEVEL,
    TABLES,
    VIEWS,
    Level,
    default_db_path,
    segments_dir,
)

logger = logging.getLogger(__name__)


def now_us() -> int:
    """Wall-clock microseconds since the epoch (comparable across the processes of a host)."""
    return time.time_ns() // 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class TelemetryConfig:
    """How a run records: ``db`` the DuckDB store (its segments live beside it, see
    ``segments_dir``), ``level``, ``flush_interval_s`` between segment flushes, ``ops_every``
    (level ``ops``: time every op on every ``ops_every``-th step, starting at step 0),
    ``ops_first`` (level ``ops``: also every step before this one, as ``distribute(calibrate=)``
    asks for its fit), and ``live_rows`` (rows per table each rank keeps in memory for live
    queries)."""

    db: Path = field(default_factory=default_db_path)
    level: Level = DEFAULT_LEVEL
    flush_interval_s: float = 2.0
    ops_every: int = 10
    live_rows: int = 100_000
    ops_first: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "db", Path(self.db))
        object.__setattr__(self, "level", Level.parse(self.level))
        if not self.flush_interval_s > 0:
            raise TelemetryError(f"flush_interval_s must be > 0, got {self.flush_interval_s!r}")
        if not (isinstance(self.ops_every, int) and self.ops_every >= 1):
            raise TelemetryError(f"ops_every must be an integer >= 1, got {self.ops_every!r}")
        if not (isinstance(self.ops_first, int) and self.ops_first >= 0):
            raise TelemetryError(f"ops_first must be an integer >= 0, got {self.ops_first!r}")
        if not (isinstance(self.live_rows, int) and self.live_rows >= 0):
            raise TelemetryError(f"live_rows must be an integer >= 0, got {self.live_rows!r}")

    @property
    def segments(self) -> Path:
        return segments_dir(self.db)

    @classmethod
    def resolve(cls, value: Any) -> TelemetryConfig | None:
        """``distribute(telemetry=...)``: None or True -> the defaults (``$MESHPLAN_TELEMETRY``
        may name the database or say ``off``; ``$MESHPLAN_TELEMETRY_LEVEL`` the level); False or
        ``"off"`` -> no telemetry; a path -> that database; a config -> itself. Returns None
        when nothing is to be recorded."""
        if isinstance(value, cls):
            return value if value.level is not Level.OFF else None
        if value is False or (isinstance(value, str) and value.strip().lower() == "off"):
            return None
        env_db = os.environ.get(ENV_DB, "").strip().lower()
        level = Level.parse(os.environ.get(ENV_LEVEL) or DEFAULT_LEVEL.name)
        if value is None or value is True:
            if env_db in ("off", "0", "false", "none") or level is Level.OFF:
                return None
            return cls(level=level)
        if isinstance(value, (str, os.PathLike)):
            return None if level is Level.OFF else cls(db=Path(value), level=level)
        raise TelemetryError(f"telemetry={value!r} is not understood; pass a database path, "
                             "False to turn it off, or meshplan.telemetry.TelemetryConfig(...)")

    def to_json(self) -> dict[str, Any]:
        return {"db": str(self.db), "level": self.level.name.lower(),
                "flush_interval_s": self.flush_interval_s, "ops_every": self.ops_every,
                "live_rows": self.live_rows, "ops_first": self.ops_first}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TelemetryConfig:
        return cls(db=Path(d["db"]), level=Level.parse(d["level"]),
                   flush_interval_s=float(d["flush_interval_s"]), ops_every=int(d["ops_every"]),
                   live_rows=int(d["live_rows"]), ops_first=int(d.get("ops_first", 0)))


# every table starts with run_id; these have rank next
_RANKED = frozenset(t for t, schema in TABLES.items() if schema.names[1:2] == ["rank"])
assert all(schema.names[0] == "run_id" for schema in TABLES.values())


def rank_dir(rank: int) -> str:
    return "controller" if rank < 0 else f"rank-{rank:05d}"


class Recorder:
    """Buffers this process's rows and flushes them as Parquet segments (module docstring)."""

    def __init__(self, root: str | os.PathLike, run_id: str, rank: int, *,
                 level: Level | str = DEFAULT_LEVEL, flush_interval_s: float | None = 2.0,
                 live_rows: int = 100_000, journal: bool = False) -> None:
        self.level = Level.parse(level)
        self.run_id, self.rank = run_id, rank
        self.dir = Path(root) / run_id / rank_dir(rank)
        self.live_rows = live_rows
        self._pending: dict[str, list[tuple]] = {t: [] for t in TABLES}
        self._recent: dict[str, collections.deque[pa.Table]] = {
            t: collections.deque() for t in TABLES}
        self._recent_rows = dict.fromkeys(TABLES, 0)
        self._lock = threading.Lock()          # guards _pending
        self._flush_lock = threading.Lock()    # one flush at a time; guards _recent and _seq
        self._seq = 0
        self._closed = False
        self._wake = threading.Event()
        self._db = None
        self.flushed_rows = 0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TelemetryError(f"cannot create the telemetry folder {self.dir}: {exc}; pass "
                                 "telemetry=PATH (or --db) somewhere writable, or "
                                 "telemetry=False") from exc
        self._thread = None
        if flush_interval_s:
            self._thread = threading.Thread(target=self._loop, args=(flush_interval_s,),
                                             name=f"meshplan-telemetry-{rank}", daemon=True)
            self._thread.start()
        # the journal (module docstring): its descriptor, number and path; rows of each
        # table's pending list already in it; the thread that writes it when woken
        self._journal: tuple[int, int, Path] | None = None
        self._journaled = dict.fromkeys(TABLES, 0)
        self._jwake = threading.Event()
        if journal:
            self._journal = self._open_journal(0)
            threading.Thread(target=self._journal_loop, name=f"meshplan-journal-{rank}",
                             daemon=True).start()
        self._exit_hook = weakref.WeakMethod(self.close)
        atexit.register(_close_at_exit, self._exit_hook)

    def wants(self, level: Level) -> bool:
        return self.level >= level

    # ---- recording ---------------------------------------------------------------------------

    def add(self, table: str, row: tuple, *, rank: int | None = None) -> None:
        """Append one row: the table's columns in order without ``run_id`` and ``rank`` (the
        recorder fills in its own; ``rank=`` records a row about another rank, as the
        controller does for a rank that died)."""
        if table in _RANKED:
            row = (self.rank if rank is None else rank, *row)
        with self._lock:
            self._pending[table].append(row)

    def add_many(self, table: str, rows: Iterable[tuple]) -> None:
        if table in _RANKED:
            rows = [(self.rank, *row) for row in rows]
        with self._lock:
            self._pending[table].extend(rows)

    # ---- the journal -------------------------------------------------------------------------

    def _open_journal(self, gen: int) -> tuple[int, int, Path]:
        path = self.dir / f".journal-{socket.gethostname()}-{os.getpid()}-{gen:06d}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        return fd, gen, path

    def journal_soon(self) -> None:
        """Have the journal thread append the rows added since its last write (a rank's
        step end: off the step's path; a no-op without a journal)."""
        if self._journal is not None:
            self._jwake.set()

    def journal(self) -> None:
        """Append the rows added since the last write to the journal, in one write."""
        with self._lock:
            if self._journal is None:
                return
            lines = []
            for table, rows in self._pending.items():
                done = self._journaled[table]
                if len(rows) > done:
                    lines += [json.dumps([table, row], default=str) for row in rows[done:]]
                    self._journaled[table] = len(rows)
            if lines:
                try:
                    os.write(self._journal[0], ("\n".join(lines) + "\n").encode())
                except OSError as exc:          # a flush still writes the rows
                    logger.warning("telemetry: could not write the journal %s: %s",
                                   self._journal[2], exc)

    def _journal_loop(self) -> None:
        while not self._closed:
            self._jwake.wait()
            self._jwake.clear()
            try:
                self.journal()
            except Exception:  # noqa: BLE001 - telemetry must never take the rank down
                logger.exception("telemetry: journal write failed")

    # ---- flushing ----------------------------------------------------------------------------

    def flush(self) -> int:
        """Write every pending row as segments now; returns the rows written."""
        with self._flush_lock:
            with self._lock:
                pending = {t: rows for t, rows in self._pending.items() if rows}
                for t in pending:
                    self._pending[t] = []
                old = self._journal                # these rows' journal: the next one starts
                if old is not None:
                    self._journal = self._open_journal(old[1] + 1)
                    self._journaled = dict.fromkeys(TABLES, 0)
            written = 0
            for table, rows in pending.items():
                arrow = self._to_arrow(table, rows)
                try:
                    self._write(table, arrow, None if old is None else old[1])
                except OSError as exc:      # keep the rows; a later flush tries again
                    logger.warning("telemetry: could not write a %s segment in %s: %s",
                                   table, self.dir, exc)
                    with self._lock:
                        self._pending[table][:0] = rows
                        self._journaled[table] += len(rows)   # in no journal from now on
                    continue
                self._remember(table, arrow)
                written += len(rows)
            if old is not None:                # its rows are in segments now
                os.close(old[0])
                old[2].unlink(missing_ok=True)
            self.flushed_rows += written
            return written

    def close(self) -> None:
        """Flush and stop the flush thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._jwake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self.flush()
        with self._lock:
            journal, self._journal = self._journal, None
        if journal is not None:                # flushed: nothing is only in it
            os.close(journal[0])
            journal[2].unlink(missing_ok=True)
        if self._db is not None:
            self._db.close()
            self._db = None

    def _loop(self, interval_s: float) -> None:
        while not self._wake.wait(interval_s):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - telemetry must never take the rank down
                logger.exception("telemetry: flush failed")

    def _to_arrow(self, table: str, rows: list[tuple]) -> pa.Table:
        return _rows_to_arrow(self.run_id, table, rows)

    def _write(self, table: str, arrow: pa.Table, journal: int | None = None) -> None:
        tag = "" if journal is None else f"j{journal:06d}-"
        _write_segment(self.dir, f"{table}-{os.getpid()}-{tag}{self._seq:06d}.parquet", arrow)
        self._seq += 1

    def _remember(self, table: str, arrow: pa.Table) -> None:
        if self.live_rows <= 0:
            return
        recent = self._recent[table]
        recent.append(arrow)
        self._recent_rows[table] += arrow.num_rows
        while recent and self._recent_rows[table] - recent[0].num_rows >= self.live_rows:
            self._recent_rows[table] -= recent.popleft().num_rows

    # ---- live queries ------------------------------------------------------------------------

    def recent(self, table: str) -> pa.Table:
        """This process's most recent rows of ``table`` (flushed or not) as one Arrow table."""
        with self._flush_lock:
            parts = list(self._recent[table])
            with self._lock:
                pending = list(self._pending[table])
        if pending:
            parts.append(self._to_arrow(table, pending))
        if not parts:
            return TABLES[table].empty_table()
        return pa.concat_tables(parts)

    def query(self, sql: str) -> pa.Table:
        """Run ``sql`` (DuckDB) over this process's recent rows; the schema's tables and views
        are defined. The connection cannot read or write files nor load extensions
        (``_sandbox``). A bad or refused query raises ``TelemetryError`` with DuckDB's message."""
        import duckdb

        from ._sandbox import connect

        if self._db is None:
            self._db = connect()
        con = self._db.cursor()
        try:
            for table in TABLES:
                con.register(table, self.recent(table))
            for name, body in VIEWS.items():
                con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS {body}")
            return con.sql(sql).to_arrow_table()
        except duckdb.Error as exc:
            raise TelemetryError(f"live query failed on rank {self.rank}: {exc}") from None
        finally:
            con.close()


def arrow_ipc(table: pa.Table) -> bytes:
    """``table`` as an Arrow IPC stream: how rows travel between processes (a rank's live
    rows and query answers to the controller, the controller's to ``meshplan serve``)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def read_ipc(data: Any) -> pa.Table:
    """The table of an Arrow IPC stream in ``data`` (bytes, or any buffer: a tensor's numpy
    view is read without a copy)."""
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def _rows_to_arrow(run_id: str, table: str, rows: list) -> pa.Table:
    schema = TABLES[table]
    names = schema.names
    cols = list(zip(*rows)) if rows else [()] * (len(names) - 1)
    arrays = [pa.array([run_id] * len(rows), type=pa.string())]
    arrays += [pa.array(col, type=schema.field(n).type) for n, col in zip(names[1:], cols)]
    return pa.Table.from_arrays(arrays, schema=schema)


def _write_segment(folder: Path, name: str, arrow: pa.Table) -> None:
    """A segment written under a temporary name and renamed into place."""
    import pyarrow.parquet as pq

    tmp = folder / f".{name}.tmp"
    pq.write_table(arrow, tmp)
    os.replace(tmp, folder / name)


_JOURNAL = re.compile(r"^\.journal-(.+)-(\d+)-(\d{6})\.jsonl$")


def recover_journals(run_dir: str | os.PathLike, *, gone_here: bool = False,
                     ranks: str = "*") -> int:
    """Turn the journals that processes of the run in ``run_dir`` (``<segments>/<run_id>``)
    left into segments, and remove them; call it once none of those processes runs
    (``gone_here``: only the journals of processes of this host that are gone, for a run
    whose processes may still be running). ``ranks``: the rank folders to look in (a
    glob). A table whose segment of that journal exists was flushed: its lines are
    skipped. Returns the rows recovered."""
    root = Path(run_dir)
    recovered = 0
    here = socket.gethostname()
    for path in sorted(root.glob(f"{ranks}/.journal-*.jsonl")):
        found = _JOURNAL.match(path.name)
        if found is None:
            continue
        host, pid, gen = found.groups()
        if gone_here and (host != here or _alive(int(pid))):
            continue
        rows: dict[str, list] = {}
        try:
            text = path.read_text(errors="replace")
        except OSError as exc:
            logger.warning("telemetry: cannot read the journal %s: %s", path, exc)
            continue
        for line in text.splitlines():
            try:
                table, row = json.loads(line)
            except (ValueError, TypeError):       # the last line, cut by the kill
                continue
            if table in TABLES:
                rows.setdefault(table, []).append(row)
        for table, got in rows.items():
            if any(path.parent.glob(f"{table}-{pid}-j{gen}-*.parquet")):
                continue                          # flushed before the process died
            try:
                _write_segment(path.parent, f"{table}-{pid}-j{gen}-journal.parquet",
                               _rows_to_arrow(root.name, table, got))
            except (OSError, pa.ArrowException) as exc:
                logger.warning("telemetry: could not recover %d %s rows from %s: %s",
                               len(got), table, path, exc)
                break
            recovered += len(got)
        else:
            path.unlink(missing_ok=True)
    return recovered


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _close_at_exit(ref: weakref.WeakMethod) -> None:
    close = ref()
    if close is not None:
        try:
            close()
        except Exception:  # noqa: BLE001 - exiting anyway
            logger.exception("telemetry: final flush failed")


__all__ = ["Recorder", "TelemetryConfig", "arrow_ipc", "now_us", "rank_dir", "read_ipc"]
