"""The SQL store: a DuckDB file holding the tables of ``_schema.TABLES``, fed from the ranks'
Parquet segments.

``Store.open(path)`` opens (or creates) the database, creates any missing table and the views,
and ingests every finished segment it has not seen yet. DuckDB lets one process hold a database
file; when another process holds it, the store reads the segments directly instead (an in-memory
database whose tables are views over the Parquet files) and says so in ``Store.source``.
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
import pyarrow.parquet as pq

from .._errors import TelemetryError
from ._schema import TABLES, VIEWS, default_db_path, segment_glob, segments_dir

logger = logging.getLogger(__name__)

BOOKKEEPING = "meshplan_segments"
_BOOKKEEPING_DDL = (f"CREATE TABLE IF NOT EXISTS {BOOKKEEPING} (path VARCHAR, table_name VARCHAR, "
                    "rows BIGINT, size BIGINT, ingested_us BIGINT)")
_SQL_TYPES = {pa.string(): "VARCHAR", pa.int32(): "INTEGER", pa.int64(): "BIGINT",
              pa.float64(): "DOUBLE", pa.bool_(): "BOOLEAN", pa.float32(): "FLOAT"}
_LOCK_PID = re.compile(r"\(PID (\d+)\)")


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


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _file_list(paths: list[Path]) -> str:
    return "[" + ", ".join(_literal(str(p)) for p in paths) + "]"


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


def _check_segment(seg: Segment) -> str | None:
    """None when the segment's Parquet footer reads; else why not."""
    try:
        pq.read_metadata(seg.path)
    except Exception as e:   # noqa: BLE001 - any unreadable file is skipped with its reason
        return f"{type(e).__name__}: {e}"
    return None


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
             segments: str | os.PathLike | None = None, ingest: bool = True) -> Store:
        """Open the database at ``db_path`` (default ``default_db_path()``), creating it and its
        folder when missing, then ingest new segments from ``segments`` (default
        ``segments_dir(db_path)``). A database locked by another process -> read the segments."""
        path = Path(db_path) if db_path is not None else default_db_path()
        root = Path(segments) if segments is not None else segments_dir(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TelemetryError(f"cannot create the telemetry folder {path.parent}: {e}") from None
        try:
            con = duckdb.connect(str(path))
        except duckdb.Error as e:
            msg = str(e)
            if "lock" in msg.lower():
                return cls._open_segments(path, root, msg)
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
        bad = {s: why for s in found if (why := _check_segment(s))}
        segs = [s for s in found if s not in bad]
        if not segs:
            raise TelemetryError(
                f"telemetry database {path} is locked by {holder} and there are no segments at "
                f"{root} to read instead; close that process (or wait for it to finish), or "
                "pass --db another path") from None
        con = duckdb.connect()
        for table, schema in TABLES.items():
            files = [s.path for s in segs if s.table == table]
            con.execute(f"CREATE VIEW {_quote(table)} AS {_select_as_schema(con, schema, files)}")
        _create_views(con)
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
        rows: dict[Segment, int] = {}
        for seg in new:
            try:
                rows[seg] = pq.read_metadata(seg.path).num_rows
            except Exception as e:   # noqa: BLE001 - any unreadable file is skipped
                skipped.append((str(seg.path), f"{type(e).__name__}: {e}"))
        good = [s for s in new if s in rows]
        try:
            self._load(good, rows)
        except duckdb.Error:      # a file whose footer reads but whose rows don't read or insert
            bad = {s: why for s in good if (why := self._probe(s, rows))}
            skipped += [(str(s.path), why) for s, why in bad.items()]
            good = [s for s in good if s not in bad]
            try:
                self._load(good, rows)
            except duckdb.Error as e:
                raise TelemetryError(f"ingesting {len(good)} segments from {self.segments} "
                                     f"failed: {e}") from None
        for path, why in skipped:
            logger.warning("telemetry: skipped unreadable segment %s (%s); it is retried on the "
                           "next ingest", path, why)
        self.last_ingest = IngestResult(sum(rows[s] for s in good), len(good), tuple(skipped))
        self.skipped = self.last_ingest.skipped
        return self.last_ingest

    def _load(self, segs: list[Segment], rows: dict[Segment, int], *, commit: bool = True) -> None:
        """Insert ``segs`` and their bookkeeping rows in one transaction (rolled back instead of
        committed with ``commit=False``)."""
        if not segs:
            return
        con = self._con
        con.execute("SET preserve_insertion_order = false")   # parallel inserts; ~15% faster
        con.execute("BEGIN")
        try:
            for table, schema in TABLES.items():
                files = [s.path for s in segs if s.table == table]
                if not files:
                    continue
                scan = f"read_parquet({_file_list(files)}, union_by_name=true)"
                have = [r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {scan}").fetchall()]
                cols = ", ".join(_quote(c) for c in have if c in schema.names)
                if cols:
                    con.execute(f"INSERT INTO {_quote(table)} BY NAME SELECT {cols} FROM {scan}")
            _record(con, segs, rows)
            con.execute("COMMIT" if commit else "ROLLBACK")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        finally:
            con.execute("RESET preserve_insertion_order")

    def _probe(self, seg: Segment, rows: dict[Segment, int]) -> str | None:
        """None when the segment reads and inserts on its own (then rolled back); else why not."""
        try:
            self._load([seg], rows, commit=False)
        except duckdb.Error as e:
            return str(e).splitlines()[0]
        return None

    # ---- queries -------------------------------------------------------------------------

    def sql(self, query: str, params: list[Any] | dict[str, Any] | None = None) -> pa.Table:
        """The answer to ``query`` as a ``pyarrow.Table`` (empty for a statement without rows)."""
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


def _select_as_schema(con: duckdb.DuckDBPyConnection, schema: pa.Schema, files: list[Path]) -> str:
    """A SELECT with exactly ``schema``'s columns over ``files`` (NULL for a column no file has;
    no rows when there are no files)."""
    have: set[str] = set()
    scan = ""
    if files:
        scan = f"read_parquet({_file_list(files)}, union_by_name=true)"
        have = {r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {scan}").fetchall()}
    cols = ", ".join(f"CAST({_quote(f.name) if f.name in have else 'NULL'} AS "
                     f"{_sql_type(f.type)}) AS {_quote(f.name)}" for f in schema)
    return f"SELECT {cols} FROM {scan}" if files else f"SELECT {cols} WHERE false"
