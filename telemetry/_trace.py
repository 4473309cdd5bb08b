"""A run as a Chrome Trace Event file (loads in Perfetto and chrome://tracing).

One process per rank (``pid`` = rank; the controller, rank -1, is ``pid`` 1000000), with threads
for steps (tid 0), collectives (tid 1) and ops (tid 2); each is a complete ("X") span in
microseconds since the run's first event. Failures are instant ("i") events.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from .._errors import TelemetryError
from ._store import Store
from ._summary import resolve_run

CONTROLLER_PID = 1_000_000
THREADS = {0: "steps", 1: "collectives", 2: "ops"}
_SPANS = (  # tid, table, name expression, arg columns
    (0, "steps", "'step ' || step", ("step", "loss", "comm_us", "comm_bytes", "collectives")),
    (1, "collectives", "kind || ' ' || coalesce(axis, '')",
     ("step", "seq", "kind", "axis", "group_size", "bytes", "value", "node")),
    (2, "ops", "coalesce(target, node)", ("step", "seq", "node", "target")),
)


def _pid(rank: int) -> int:
    return CONTROLLER_PID if rank == -1 else rank


def _safe(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def chrome_trace(store: Store, run_id: str | None = None) -> dict[str, Any]:
    """The run ``run_id`` (default: the latest) as a Chrome Trace Event dict."""
    run = resolve_run(store, run_id)
    t0 = store.sql("""
        SELECT min(t) AS t0 FROM (
            SELECT min(start_us) AS t FROM steps WHERE run_id = $run
            UNION ALL SELECT min(start_us) FROM collectives WHERE run_id = $run
            UNION ALL SELECT min(start_us) FROM ops WHERE run_id = $run
            UNION ALL SELECT min(time_us) FROM failures WHERE run_id = $run)""",
                   {"run": run}).column("t0")[0].as_py() or 0
    events: list[dict[str, Any]] = []
    used: dict[int, set[int]] = {}
    for tid, table, name, args in _SPANS:
        cols = ", ".join(f'"{a}"' for a in args)
        rows = store.sql(f"SELECT rank, {name} AS name, start_us, dur_us, {cols} FROM {table} "
                         "WHERE run_id = $run AND start_us IS NOT NULL ORDER BY rank, start_us",
                         {"run": run}).to_pylist()
        for r in rows:
            used.setdefault(r["rank"], set()).add(tid)
            events.append({"name": r["name"] or table, "cat": table, "ph": "X",
                           "ts": r["start_us"] - t0, "dur": max(int(r["dur_us"] or 0), 0),
                           "pid": _pid(r["rank"]), "tid": tid,
                           "args": {a: _safe(r[a]) for a in args if r[a] is not None}})
    for r in store.sql("SELECT rank, time_us, step, kind, error, source FROM failures "
                       "WHERE run_id = $run ORDER BY time_us", {"run": run}).to_pylist():
        used.setdefault(r["rank"], set()).add(0)
        events.append({"name": f"failure: {r['kind']}", "cat": "failures", "ph": "i", "s": "p",
                       "ts": (r["time_us"] or t0) - t0, "pid": _pid(r["rank"]), "tid": 0,
                       "args": {k: r[k] for k in ("step", "error", "source") if r[k] is not None}})
    return {"traceEvents": _metadata(store, run, used) + events, "displayTimeUnit": "ms",
            "otherData": {"run_id": run, "source": store.source, "time_origin_us": t0}}


def _metadata(store: Store, run: str, used: dict[int, set[int]]) -> list[dict[str, Any]]:
    hosts = {r["rank"]: r["host"] for r in store.sql(
        "SELECT rank, any_value(host) AS host FROM ranks WHERE run_id = $run GROUP BY rank",
        {"run": run}).to_pylist()}
    meta: list[dict[str, Any]] = []
    for rank in sorted(used):
        pid = _pid(rank)
        who = "controller" if rank == -1 else f"rank {rank}"
        name = f"{who} ({hosts[rank]})" if hosts.get(rank) else who
        meta.append({"name": "process_name", "ph": "M", "ts": 0, "pid": pid, "tid": 0,
                     "args": {"name": name}})
        meta.append({"name": "process_sort_index", "ph": "M", "ts": 0, "pid": pid, "tid": 0,
                     "args": {"sort_index": pid}})
        for tid in sorted(used[rank]):
            meta.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": pid, "tid": tid,
                         "args": {"name": THREADS[tid]}})
    return meta


def write_trace(store: Store, path: str | os.PathLike, run_id: str | None = None) -> int:
    """Write the run's trace to ``path`` atomically; returns the number of events."""
    trace = chrome_trace(store, run_id)
    out = Path(path)
    if not out.parent.is_dir():
        raise TelemetryError(f"--out {out}: folder {out.parent} does not exist; create it first")
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(trace, f, separators=(",", ":"), allow_nan=False)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(trace["traceEvents"])
