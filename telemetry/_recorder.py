"""The per-rank recorder: rows buffered in memory, flushed as Parquet segments, queryable live.

One ``Recorder`` per process of a run (every rank, and the controller as rank ``-1``). ``add``
appends a row (a tuple in the table's column order, see ``_schema.TABLES``) under a lock: a
list append, cheap enough for every collective of every step. A daemon thread flushes what is
pending every ``flush_interval_s`` as one Parquet segment per table,
``<root>/<run_id>/<rank-dir>/<table>-<pid>-<seq>.parquet``, written under a temporary name and
renamed into place, so a reader never sees half a file and a rank that crashes keeps everything
flushed before it. ``flush()`` is also called at ``close()``, at interpreter exit and by the
runtime right after a failure; rows added after the last flush of a process killed by SIGKILL
are lost (they were only in its memory).

The most recent rows (``live_rows`` per table, flushed or not) stay in memory as Arrow tables,
so ``query(sql)`` answers over this rank's recent events without touching disk: the runtime's
live fan-out query sends the same SQL to every worker and merges the answers.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
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
                 live_rows: int = 100_000) -> None:
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

    # ---- flushing ----------------------------------------------------------------------------

    def flush(self) -> int:
        """Write every pending row as segments now; returns the rows written."""
        with self._flush_lock:
            with self._lock:
                pending = {t: rows for t, rows in self._pending.items() if rows}
                for t in pending:
                    self._pending[t] = []
            written = 0
            for table, rows in pending.items():
                arrow = self._to_arrow(table, rows)
                try:
                    self._write(table, arrow)
                except OSError as exc:      # keep the rows; a later flush tries again
                    logger.warning("telemetry: could not write a %s segment in %s: %s",
                                   table, self.dir, exc)
                    with self._lock:
                        self._pending[table][:0] = rows
                    continue
                self._remember(table, arrow)
                written += len(rows)
            self.flushed_rows += written
            return written

    def close(self) -> None:
        """Flush and stop the flush thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self.flush()
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
        schema = TABLES[table]
        names = schema.names
        cols = list(zip(*rows)) if rows else [()] * (len(names) - 1)
        arrays = [pa.array([self.run_id] * len(rows), type=pa.string())]
        arrays += [pa.array(col, type=schema.field(n).type) for n, col in zip(names[1:], cols)]
        return pa.Table.from_arrays(arrays, schema=schema)

    def _write(self, table: str, arrow: pa.Table) -> None:
        import pyarrow.parquet as pq

        name = f"{table}-{os.getpid()}-{self._seq:06d}.parquet"
        self._seq += 1
        path = self.dir / name
        tmp = self.dir / f".{name}.tmp"
        pq.write_table(arrow, tmp)
        os.replace(tmp, path)

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


def _close_at_exit(ref: weakref.WeakMethod) -> None:
    close = ref()
    if close is not None:
        try:
            close()
        except Exception:  # noqa: BLE001 - exiting anyway
            logger.exception("telemetry: final flush failed")


__all__ = ["Recorder", "TelemetryConfig", "now_us", "rank_dir"]
