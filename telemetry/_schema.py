"""The telemetry tables: one Arrow schema per table, the recording levels, where files live.

``SCHEMA.md`` (next to this file) documents every column; ``tests/unit/test_telemetry_schema.py``
checks that the two agree. Timestamps are wall-clock microseconds since the Unix epoch (``_us``);
durations are microseconds; sizes are bytes. ``rank`` is the rank in the run's mesh (row-major
over the mesh axes), ``-1`` for the controller.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

import pyarrow as pa

SCHEMA_VERSION = 1

_s, _i32, _i64, _f64 = pa.string(), pa.int32(), pa.int64(), pa.float64()


def _schema(*cols: tuple[str, pa.DataType]) -> pa.Schema:
    return pa.schema([pa.field(name, typ) for name, typ in cols])


TABLES: dict[str, pa.Schema] = {
    "runs": _schema(
        ("run_id", _s), ("start_us", _i64), ("step_name", _s), ("mesh", _s), ("world_size", _i32),
        ("strategy", _s), ("topology", _s), ("plan_hash", _s), ("est_step_us", _f64),
        ("est_peak_bytes", _i64), ("level", _s), ("host", _s), ("pid", _i32),
        ("meshplan_version", _s), ("torch_version", _s)),
    "ranks": _schema(
        ("run_id", _s), ("rank", _i32), ("host", _s), ("pid", _i32), ("coords", _s),
        ("device", _s), ("start_us", _i64)),
    "steps": _schema(
        ("run_id", _s), ("rank", _i32), ("step", _i64), ("start_us", _i64), ("dur_us", _i64),
        ("loss", _f64), ("comm_us", _i64), ("comm_bytes", _i64), ("collectives", _i32)),
    "collectives": _schema(
        ("run_id", _s), ("rank", _i32), ("step", _i64), ("seq", _i32), ("kind", _s), ("axis", _s),
        ("group_size", _i32), ("bytes", _i64), ("start_us", _i64), ("dur_us", _i64),
        ("value", _s), ("node", _s)),
    "ops": _schema(
        ("run_id", _s), ("rank", _i32), ("step", _i64), ("seq", _i32), ("node", _s),
        ("target", _s), ("start_us", _i64), ("dur_us", _i64)),
    "memory": _schema(
        ("run_id", _s), ("rank", _i32), ("step", _i64), ("device", _s), ("state_bytes", _i64),
        ("allocated_bytes", _i64), ("peak_bytes", _i64), ("tensor_peak_bytes", _i64)),
    "failures": _schema(
        ("run_id", _s), ("rank", _i32), ("time_us", _i64), ("step", _i64), ("kind", _s),
        ("error", _s), ("source", _s), ("traceback", _s)),
    "recoveries": _schema(
        ("run_id", _s), ("rank", _i32), ("time_us", _i64), ("step", _i64), ("ranks", _s),
        ("kind", _s), ("restart", _i32), ("restored_step", _i64), ("replayed", _i32),
        ("recover_us", _i64), ("mesh", _s), ("world_size", _i32), ("strategy", _s),
        ("est_step_us", _f64)),
    "stacks": _schema(
        ("run_id", _s), ("rank", _i32), ("time_us", _i64), ("step", _i64), ("reason", _s),
        ("doing", _s), ("frame", _s), ("stack", _s)),
    "plan_nodes": _schema(
        ("run_id", _s), ("node", _s), ("target", _s), ("kind", _s), ("phase", _s),
        ("module", _s), ("source", _s), ("inputs", _s), ("outputs", _s),
        ("est_compute_us", _f64), ("flops", _f64), ("bytes", _f64), ("dtype", _s),
        # the fused kernel the node runs inside (priced as the kernel: its work on the anchor)
        ("kernel", _s)),
    "plan_collectives": _schema(
        ("run_id", _s), ("value", _s), ("node", _s), ("seq", _i32), ("kind", _s), ("axis", _s),
        ("group_size", _i32), ("bytes", _i64), ("est_us", _f64),
        # an all-reduce the lowering merges: its bucket (numbered per step; NULL: a call of
        # its own) and 1 when the cost model hides part of the bucket's wire time
        ("bucket", _i32), ("bucket_overlaps", _i32)),
    "link_probes": _schema(
        ("run_id", _s), ("rank", _i32), ("kind", _s), ("axis", _s), ("group_size", _i32),
        ("bytes", _i64), ("dur_us", _f64)),
}

# Views every store defines over the tables (SQL; ``{t}`` placeholders are not used).
VIEWS: dict[str, str] = {
    # The plan's estimate for every collective next to what the ranks measured (mean over ranks
    # and steps). Rows the plan priced but no rank ran have measured_calls = 0; that difference
    # is the cost model's to learn from.
    "collectives_vs_plan": """
        SELECT p.run_id, p.value, p.node, p.seq, p.kind, p.axis, p.group_size,
               p.bytes AS predicted_bytes, p.est_us AS predicted_us,
               count(c.rank) AS measured_calls,
               avg(c.bytes) AS measured_bytes,
               avg(c.dur_us) AS measured_us,
               quantile_cont(c.dur_us, 0.5) AS measured_p50_us
        FROM plan_collectives p
        LEFT JOIN collectives c
          ON c.run_id = p.run_id AND c.value = p.value AND c.node = p.node
         AND c.kind = p.kind AND c.axis = p.axis
        GROUP BY ALL""",
    # The plan's compute estimate per node next to the sampled op timings (level 'ops').
    "ops_vs_plan": """
        SELECT p.run_id, p.node, p.target, p.phase, p.module, p.source,
               p.est_compute_us AS predicted_us,
               count(o.rank) AS measured_calls,
               avg(o.dur_us) AS measured_us,
               quantile_cont(o.dur_us, 0.5) AS measured_p50_us
        FROM plan_nodes p
        LEFT JOIN ops o ON o.run_id = p.run_id AND o.node = p.node
        GROUP BY ALL""",
}


class Level(enum.IntEnum):
    """What a run records. Each level includes the ones before it."""

    OFF = 0
    STEPS = 1          # runs, ranks, steps, memory, failures, recoveries, stacks, plan_nodes,
                       # plan_collectives, link_probes
    COLLECTIVES = 2    # + one row per collective call (the default)
    OPS = 3            # + per-node op timings on sampled steps

    @classmethod
    def parse(cls, value: object) -> Level:
        if isinstance(value, Level):
            return value
        if value is None or value is False:
            return cls.OFF
        name = str(value).strip().lower()
        for level in cls:
            if level.name.lower() == name:
                return level
        from .._errors import TelemetryError

        raise TelemetryError(f"unknown telemetry level {value!r}; use one of "
                             f"{[lv.name.lower() for lv in cls]}")


DEFAULT_LEVEL = Level.COLLECTIVES
ENV_DB = "MESHPLAN_TELEMETRY"            # a database path, or "off"
ENV_LEVEL = "MESHPLAN_TELEMETRY_LEVEL"   # off | steps | collectives | ops
DEFAULT_DB = Path(".meshplan") / "telemetry.duckdb"


def default_db_path() -> Path:
    """``$MESHPLAN_TELEMETRY`` when set (and not ``off``), else ``.meshplan/telemetry.duckdb``
    under the current directory."""
    env = os.environ.get(ENV_DB, "").strip()
    if env and env.lower() not in ("off", "0", "false", "none"):
        return Path(env)
    return DEFAULT_DB


def segments_dir(db_path: str | os.PathLike) -> Path:
    """Where the ranks' Parquet segments live for the database at ``db_path``:
    ``telemetry.duckdb`` -> ``telemetry.segments/`` beside it."""
    p = Path(db_path)
    return p.with_name(p.stem + ".segments")


def segment_glob(root: str | os.PathLike, table: str) -> str:
    """The glob matching every finished segment of ``table`` under ``root`` (all runs, ranks)."""
    return str(Path(root) / "*" / "*" / f"{table}-*.parquet")


__all__ = ["DEFAULT_DB", "DEFAULT_LEVEL", "ENV_DB", "ENV_LEVEL", "Level", "SCHEMA_VERSION",
           "TABLES", "VIEWS", "default_db_path", "segment_glob", "segments_dir"]
