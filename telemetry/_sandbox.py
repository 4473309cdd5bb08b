"""DuckDB connections for SQL written outside this package.

Every connection that runs SQL text from a user -- a live query on each rank
(``Recorder.query``), its ``merge`` on the controller, the store behind ``Store.sql`` and
``meshplan telemetry sql`` -- is made by ``connect`` here, and so is any later one. Such a
connection cannot touch the filesystem or the network: ``enable_external_access`` is off (no
``COPY ... TO``, no ``read_text``/``read_csv``/``read_parquet``/``glob`` of a path, no
``ATTACH``, ``EXPORT DATABASE``, ``INSTALL`` or ``LOAD`` of an extension file, no Python
replacement scans of the caller's variables); extensions are never installed or loaded on
demand, community ones not at all; and ``lock_configuration`` makes every later ``SET``,
``RESET`` or ``PRAGMA`` that changes a setting an error, so a query cannot turn any of this back
on. The settings are given to ``duckdb.connect``, so they hold before the first statement.

Data reaches such a connection only through what its owner registers (Arrow tables, pyarrow
datasets: read by pyarrow, not by DuckDB) and, for a database file, that file itself (DuckDB
keeps its own database, WAL and spill files). DuckDB is imported on first use: recording ranks
that are never queried do not load it.
"""

from __future__ import annotations

import os
from typing import Any

# Order matters only for SET; given at connect, DuckDB applies them before it starts.
LOCKED: dict[str, Any] = {
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
    "enable_external_access": False,
    "lock_configuration": True,
}


def connect(database: str | os.PathLike = ":memory:") -> Any:
    """A DuckDB connection to ``database`` (in memory by default) locked as the module says.
    Errors are DuckDB's (``duckdb.Error``), as from ``duckdb.connect``."""
    import duckdb

    return duckdb.connect(str(database), config=dict(LOCKED))


__all__ = ["LOCKED", "connect"]
