"""Telemetry: what every rank did, as SQL tables.

Owns the event schema, the per-rank recorders (Arrow batches), the store (DuckDB, an embedded file
by default, with Parquet segments per rank), distributed queries that fan out to live workers, and
trace export to the Chrome/Perfetto format. A leaf: imports nothing of ours but
`meshplan._errors`, and every other stage may import it.

Tables and columns: ``telemetry/SCHEMA.md``. ``Store.open()`` opens the database and ingests
new segments; ``summary``, ``chrome_trace`` and ``meshplan telemetry`` read it.
"""

from ._recorder import Recorder, TelemetryConfig, now_us
from ._schema import TABLES, VIEWS, Level, default_db_path, segments_dir

# The store, summary and trace load DuckDB on first use: recording ranks never need it.
_LAZY = {"IngestResult": "_store", "Store": "_store", "render_summary": "_summary",
         "summary": "_summary", "chrome_trace": "_trace", "write_trace": "_trace"}


def __getattr__(name: str):  # noqa: ANN202
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__: list[str] = [
    "IngestResult",
    "Level",
    "Recorder",
    "Store",
    "TABLES",
    "TelemetryConfig",
    "VIEWS",
    "chrome_trace",
    "default_db_path",
    "now_us",
    "render_summary",
    "segments_dir",
    "summary",
    "write_trace",
]
