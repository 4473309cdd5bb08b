"""The SQL store: a DuckDB file holding the tables of ``_schema.TABLES``, fed from the ranks'
Parquet segments.

``Store.open(path)`` opens (or creates) the database, creates any missing table and the views,
and ingests every finished segment it has not seen yet. DuckDB lets one process hold a database
file; when another process holds it, the store reads the segments directly instead (an in-memory
database whose tables are views over the Parquet files) and says so in ``Store.source``.

Either way the connection is made by ``_sandbox.connect``: the SQL a user hands ``Store.sql``
cannot read or write files, attach databases or load extensions. So DuckDB never opens a segment
itself: pyarrow reads them, as datasets registered on the connection (one per table and column
layout), for ingest and for the views of the fallback alike.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from .._errors import TelemetryError
from ._sandbox import connect
from ._schema import TABLES, VIEWS, default_db_path, segment_glob, segments_dir

logger = logging.getLogger(__name__)

BOOKKEEPING = "meshplan_segments"
_BOOKKEEPING_DDL = (f"CREATE TABLE IF NOT EXISTS {BOOKKEEPING} (path VARCHAR, table_name VARCHAR, "
                    "rows BIGINT, size BIGINT, ingested_us BIGINT)")
_SQL_TYPES = {pa.string(): "VARCHAR", pa.int32(): "INTEGER", pa.int64(): "BIGINT",
              pa.float64(): "DOUBLE", pa.bool_(): "BOOLEAN", pa.float32(): "FLOAT"}
_LOCK_PID = re.compile(r"\(PID (\d+)\)")
# DuckDB's words for a file another process holds ("block" in a checksum error is not a lock)
_LOCKED = re.compile(r"Could not set lock on file|Conflicting lock", re.IGNORECASE)
# what reading a segment through a registered dataset can raise (DuckDB wraps what pyarrow
# raises during the scan; opening the dataset raises pyarrow's own)
_READ_ERRORS = (duckdb.Error, pa.ArrowException, OSError)


@dataclass(frozen=True, slots=True)
class Segment:
    path: Path          # absolute
    key: str            # path relative to the segments root (run/rank-dir/file), as recorded
    table: str
    size: int


@dataclass(frozen=True, slots=True)
class IngestResult:
    """What one ``Store.ingest()`` did: rows and segments loaded, segments skipped and why."""

    rows: int = 0
    segments: int = 0
    skipped: tuple[tuple[str, str], ...] = ()     # (segment path, reason)


def _sql_type(typ: pa.DataType) -> str:
    try:
        return _SQL_TYPES[typ]
    except KeyError:
        raise TelemetryError(f"telemetry schema type {typ} has no DuckDB type in "
                             "telemetry/_store.py _SQL_TYPES; add it there") from None


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def find_segments(root: Path) -> list[Segment]:
    """Every finished segment under ``root`` (temporary files are not matched), sorted."""
    found = []
    for table in TABLES:
        for path in sorted(Path(root).glob(str(Path(segment_glob(".", table))))):
            try:
                size = path.stat().st_size
            except OSError:                       # raced with a rename; the next ingest sees it
                continue
            found.append(Segment(path, path.relative_to(root).as_posix(), table, size))
    return found


def _footer(seg: Segment) -> pq.FileMetaData | str:
    """The segment's Parquet footer; why not when it does not read."""
    try:
        return pq.read_metadata(seg.path)
    except Exception as e:   # noqa: BLE001 - any unreadable file is skipped with its reason
        return f"{type(e).__name__}: {e}"


def _layouts(segs: list[Segment], footers: dict[Segment, pq.FileMetaData]
             ) -> list[tuple[pa.Schema, list[Path]]]:
    """``segs`` (of one table) grouped by column layout: (schema, files) per group, in order."""
    groups: dict[tuple, tuple[pa.Schema, list[Path]]] = {}
    for s in segs:
        schema = footers[s].schema.to_arrow_schema().remove_metadata()
        key = tuple((f.name, str(f.type), f.nullable) for f in schema)
        groups.setdefault(key, (schema, []))[1].append(s.path)
    return list(groups.values())


def _dataset(schema: pa.Schema, files: list[Path]) -> ds.Dataset:
    return ds.dataset([str(p) for p in files], schema=schema, format="parquet")


class DatabaseLocked(TelemetryError):
    """The database is open in another process (``holder``: its PID, when DuckDB says)."""

    def __init__(self, path: Path, holder: str | None) -> None:
        super().__init__(f"telemetry database {path} is open in another process"
                         + (f" (PID {holder})" if holder else ""))
        self.path, self.holder = path, holder


class Store:
    """The telemetry tables of one database (or, when it is locked, of its segments).

    ``sql(q)`` answers a query as a ``pyarrow.Table``; ``tables()`` names what can be queried;
    ``source`` says what the store reads.
    """

    def __init__(self, con: duckdb.DuckDBPyConnection, *, source: str, db_path: Path,
                 segments: Path, fallback: bool) -> None:
        self._con = con
        self.source = source
        self.db_path = db_path
        self.segments = segments
        self.fallback = fallback
        self.last_ingest = IngestResult()
        # segments it could not read: at open (reading segments) or in the last ingest
        self.skipped: tuple[tuple[str, str], ...] = ()

    # ---- opening -------------------------------------------------------------------------

    @classmethod
    def open(cls, db_path: str | os.PathLike | None = None, *,
             segments: str | os.PathLike | None = None, ingest: bool = True,
             if_locked: str = "segments") -> Store:
        """Open the database at ``db_path`` (default ``default_db_path()``), creating it and its
        folder when missing, then ingest new segments from ``segments`` (default
        ``segments_dir(db_path)``). A database locked by another process -> read the segments
        (``if_locked="segments"``), or ``DatabaseLocked`` (``if_locked="raise"``)."""
        path = Path(db_path) if db_path is not None else default_db_path()
        root = Path(segments) if segments is not None else segments_dir(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TelemetryError(f"cannot create the telemetry folder {path.parent}: {e}") from None
        try:
            con = connect(path)
        except duckdb.Error as e:
            msg = str(e)
            if _LOCKED.search(msg):
                if if_locked == "raise":
                    pid = _LOCK_PID.search(msg)
                    raise DatabaseLocked(path, pid.group(1) if pid else None) from None
                return cls._open_segments(path, root, msg)
            if "Corrupt database file" in msg or "does not match stored checksum" in msg:
                raise TelemetryError(
                    f"telemetry database {path} is damaged ({msg.splitlines()[0]}); move it "
                    "away and open again: a new database is built from the segments still at "
                    f"{root}, or pass --db another path") from None
            if "not a valid DuckDB database" in msg:
                raise TelemetryError(f"{path} is not a DuckDB database (corrupt, or another "
                                     "file); move it away or pass --db another path") from None
            raise TelemetryError(f"cannot open telemetry database {path}: {msg}") from None
        store = cls(con, source=f"database {path}", db_path=path, segments=root, fallback=False)
        try:
            store._create()
            if ingest:
                store.ingest()
        except BaseException:
            store.close()
            raise
        return store

    @classmethod
    def _open_segments(cls, path: Path, root: Path, lock_msg: str) -> Store:
        pid_match = _LOCK_PID.search(lock_msg)
        holder = f"PID {pid_match.group(1)}" if pid_match else "another process"
        found = find_segments(root) if root.is_dir() else []
        footers = {s: _footer(s) for s in found}
        bad = {s: why for s, why in footers.items() if isinstance(why, str)}
        segs = [s for s in found if s not in bad]
        if not segs:
            raise TelemetryError(
                f"telemetry database {path} is locked by {holder} and there are no segments at "
                f"{root} to read instead; close that process (or wait for it to finish), or "
                "pass --db another path") from None
        con = connect()
        try:
            for table, schema in TABLES.items():
                selects = []
                for i, (layout, files) in enumerate(
                        _layouts([s for s in segs if s.table == table], footers)):
                    name = f"_segments_{table}_{i}"
                    con.register(name, _dataset(layout, files))
                    selects.append(_select_as_schema(schema, name, set(layout.names)))
                body = " UNION ALL ".join(selects) or _select_as_schema(schema, None, set())
                con.execute(f"CREATE VIEW {_quote(table)} AS {body}")
            _create_views(con)
        except BaseException:
            con.close()
            raise
        source = f"segments {root} (database {path} locked by {holder})"
        logger.warning("telemetry: reading %s", source)
        store = cls(con, source=source, db_path=path, segments=root, fallback=True)
        store.skipped = tuple((str(s.path), why) for s, why in bad.items())
        for p, why in store.skipped:
            logger.warning("telemetry: skipped unreadable segment %s (%s)", p, why)
        return store

    def _create(self) -> None:
        con = self._con
        try:
            con.execute("BEGIN")
            for table, schema in TABLES.items():
                cols = ", ".join(f"{_quote(f.name)} {_sql_type(f.type)}" for f in schema)
                con.execute(f"CREATE TABLE IF NOT EXISTS {_quote(table)} ({cols})")
                have = {r[0] for r in con.execute(
                    "SELECT column_name FROM information_schema.columns WHERE table_name = ? "
                    "AND table_schema = 'main'", [table]).fetchall()}
                for f in schema:                  # a database made by an older schema
                    if f.name not in have:
                        con.execute(f"ALTER TABLE {_quote(table)} ADD COLUMN {_quote(f.name)} "
                                    f"{_sql_type(f.type)}")
            con.execute(_BOOKKEEPING_DDL)
            _create_views(con)
            con.execute("COMMIT")
        except duckdb.Error as e:
            con.execute("ROLLBACK")
            raise TelemetryError(f"cannot set up telemetry database {self.db_path}: {e}") from None

    # ---- ingest --------------------------------------------------------------------------

    def ingest(self) -> IngestResult:
        """Load every finished segment not yet ingested (by path and size), all in one
        transaction with its bookkeeping rows. Segments that cannot be read or inserted (truncated,
        a column of the wrong type) are skipped, reported and retried next time."""
        if self.fallback:
            raise TelemetryError(f"cannot ingest: {self.source}; close that process, then ingest")
        if not self.segments.is_dir():
            self.last_ingest = IngestResult()
            return self.last_ingest
        done = set(self._con.execute(f"SELECT path, size FROM {BOOKKEEPING}").fetchall())
        new = [s for s in find_segments(self.segments) if (s.key, s.size) not in done]
        skipped: list[tuple[str, str]] = []
        footers: dict[Segment, pq.FileMetaData] = {}
        for seg in new:
            footer = _footer(seg)
            if isinstance(footer, str):
                skipped.append((str(seg.path), footer))
            else:
                footers[seg] = footer
        good = [s for s in new if s in footers]
        try:
            self._load(good, footers)
        except _READ_ERRORS:      # a file whose footer reads but whose rows don't read or insert
            bad = {s: why for s in good if (why := self._probe(s, footers))}
            skipped += [(str(s.path), why) for s, why in bad.items()]
            good = [s for s in good if s not in bad]
            try:
                self._load(good, footers)
            except _READ_ERRORS as e:
                raise TelemetryError(f"ingesting {len(good)} segments from {self.segments} "
                                     f"failed: {e}") from None
        for path, why in skipped:
            logger.warning("telemetry: skipped unreadable segment %s (%s); it is retried on the "
                           "next ingest", path, why)
        self.last_ingest = IngestResult(sum(footers[s].num_rows for s in good), len(good),
                                        tuple(skipped))
        self.skipped = self.last_ingest.skipped
        return self.last_ingest

    def _load(self, segs: list[Segment], footers: dict[Segment, pq.FileMetaData], *,
              commit: bool = True) -> None:
        """Insert ``segs`` and their bookkeeping rows in one transaction (rolled back instead of
        committed with ``commit=False``). pyarrow reads the files (one dataset per table and
        column layout); the locked connection only sees the registered datasets. (The
        configuration is locked, so ``preserve_insertion_order`` stays on: inserts are not
        reordered for speed.)"""
        if not segs:
            return
        con = self._con
        scans: list[str] = []
        con.execute("BEGIN")
        try:
            for table, schema in TABLES.items():
                for layout, files in _layouts([s for s in segs if s.table == table], footers):
                    cols = ", ".join(_quote(c) for c in layout.names if c in schema.names)
                    if not cols:
                        continue
                    con.register(name := f"_segments_scan_{len(scans)}", _dataset(layout, files))
                    scans.append(name)
                    con.execute(f"INSERT INTO {_quote(table)} BY NAME SELECT {cols} FROM {name}")
            _record(con, segs, {s: footers[s].num_rows for s in segs})
            con.execute("COMMIT" if commit else "ROLLBACK")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        finally:                  # after the transaction: an aborted one refuses even this
            for name in scans:
                con.unregister(name)

    def _probe(self, seg: Segment, footers: dict[Segment, pq.FileMetaData]) -> str | None:
        """None when the segment reads and inserts on its own (then rolled back); else why not."""
        try:
            self._load([seg], footers, commit=False)
        except _READ_ERRORS as e:
            return str(e).splitlines()[0]
        return None

    # ---- queries -------------------------------------------------------------------------

    def sql(self, query: str, params: list[Any] | dict[str, Any] | None = None) -> pa.Table:
        """The answer to ``query`` as a ``pyarrow.Table`` (empty for a statement without rows).
        The query cannot read or write files, attach databases, load extensions or change a
        setting (``_sandbox``); trying is a ``TelemetryError`` with DuckDB's reason."""
        try:
            rel = self._con.sql(query, params=params) if params else self._con.sql(query)
            return rel.to_arrow_table() if rel is not None else pa.table({})
        except duckdb.Error as e:
            text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
            raise TelemetryError(f"query failed: {text}") from None

    def tables(self) -> list[str]:
        """What can be queried: the telemetry tables, then the views."""
        return [*TABLES, *VIEWS]

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.source})"


def _record(con: duckdb.DuckDBPyConnection, segs: list[Segment], rows: dict[Segment, int]) -> None:
    """The bookkeeping rows of ``segs``, inside the ingest's transaction."""
    now = int(time.time() * 1e6)
    con.executemany(f"INSERT INTO {BOOKKEEPING} VALUES (?, ?, ?, ?, ?)",
                    [(s.key, s.table, rows[s], s.size, now) for s in segs])


def _create_views(con: duckdb.DuckDBPyConnection) -> None:
    for name, body in VIEWS.items():
        con.execute(f"CREATE OR REPLACE VIEW {_quote(name)} AS {body}")


def _select_as_schema(schema: pa.Schema, source: str | None, have: set[str]) -> str:
    """A SELECT with exactly ``schema``'s columns over the registered ``source``, whose columns
    are ``have`` (NULL for a column it lacks; no rows when there is no source)."""
    cols = ", ".join(f"CAST({_quote(f.name) if f.name in have else 'NULL'} AS "
                     f"{_sql_type(f.type)}) AS {_quote(f.name)}" for f in schema)
    return f"SELECT {cols} FROM {_quote(source)}" if source else f"SELECT {cols} WHERE false"
