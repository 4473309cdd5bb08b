"""Telemetry: what every rank did, as SQL tables.

Owns the event schema, the per-rank recorders (Arrow batches), the store (DuckDB, an embedded file
by default, with Parquet segments per rank), distributed queries that fan out to live workers, and
trace export to the Chrome/Perfetto format. A leaf: imports nothing of ours but
`meshplan._errors`, and every other stage may import it.

Built in a later issue; this package is a placeholder so the layout and import direction hold.
"""

__all__: list[str] = []
