"""One run at a glance: step times per rank, stragglers and where the others wait for them, the
plan's collective estimates against what the ranks measured, and the run's failures.

``summary(store)`` returns plain JSON-safe values (``meshplan telemetry summary --json`` prints
it); ``render_summary(d)`` turns it into rich tables.
"""

from __future__ import annotations

import decimal
import math
import statistics
from typing import Any

from .._errors import TelemetryError
from ._store import Store

# A rank whose median compute time exceeds the median over ranks by more than this is slow.
STRAGGLER_RATIO = 1.10


def latest_run(store: Store) -> str:
    """The latest run by ``runs.start_us``; without ``runs`` rows, the run with the newest step."""
    for q in ("SELECT run_id FROM runs ORDER BY start_us DESC NULLS LAST LIMIT 1",
              "SELECT run_id FROM steps GROUP BY run_id ORDER BY max(start_us) DESC LIMIT 1"):
        rows = store.sql(q).column("run_id").to_pylist()
        if rows:
            return rows[0]
    raise TelemetryError(f"no runs recorded in {store.source}; run a step with telemetry on "
                         "(and `meshplan telemetry ingest`), or pass --db another database")


def resolve_run(store: Store, run_id: str | None) -> str:
    if run_id is None:
        return latest_run(store)
    known = _rows(store, "SELECT count(*) AS n FROM (SELECT run_id FROM runs UNION ALL "
                         "SELECT run_id FROM steps) WHERE run_id = ?", [run_id])[0]["n"]
    if not known:
        runs = [r["run_id"] for r in _rows(store, "SELECT DISTINCT run_id FROM runs "
                                                  "UNION SELECT DISTINCT run_id FROM steps")]
        raise TelemetryError(f"run {run_id!r} is not in {store.source}; known runs: "
                             f"{', '.join(sorted(runs)[-10:]) or 'none'}")
    return run_id


def _clean(v: Any) -> Any:
    """JSON-safe: NaN/inf -> None; DuckDB's decimal sums -> int or float."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, decimal.Decimal):
        return int(v) if v == v.to_integral_value() else float(v)
    return v


def _rows(store: Store, q: str, params: list[Any] | None = None) -> list[dict[str, Any]]:
    return [{k: _clean(v) for k, v in r.items()} for r in store.sql(q, params).to_pylist()]


def summary(store: Store, run_id: str | None = None) -> dict[str, Any]:
    """The run ``run_id`` (default: the latest) as a JSON-safe dict."""
    run = resolve_run(store, run_id)
    info = _rows(store, "SELECT * EXCLUDE (run_id) FROM runs WHERE run_id = ? "
                        "ORDER BY start_us LIMIT 1", [run])
    ranks = _ranks(store, run)
    return {"run_id": run, "run": info[0] if info else None, "ranks": ranks,
            "controller": _controller(store, run),
            "stragglers": _stragglers(store, run, ranks),
            "collectives": _collectives(store, run),
            "failures": _rows(store, "SELECT rank, time_us, step, kind, error, source "
                                     "FROM failures WHERE run_id = ? ORDER BY time_us, rank",
                              [run])}


def _ranks(store: Store, run: str) -> list[dict[str, Any]]:
    return _rows(store, """
        WITH s AS (SELECT rank, step, dur_us, coalesce(comm_us, 0) AS comm_us
                   FROM steps WHERE run_id = ? AND rank >= 0),
             m AS (SELECT rank, max(peak_bytes) AS peak_bytes, arg_max(state_bytes, step)
                   AS state_bytes FROM memory WHERE run_id = ? GROUP BY rank),
             r AS (SELECT rank, any_value(host) AS host, any_value(device) AS device,
                   any_value(coords) AS coords FROM ranks WHERE run_id = ? GROUP BY rank)
        SELECT s.rank, any_value(r.host) AS host, any_value(r.coords) AS coords,
               any_value(r.device) AS device, count(*) AS steps,
               quantile_cont(s.dur_us, 0.5) AS step_p50_us,
               quantile_cont(s.dur_us, 0.95) AS step_p95_us,
               quantile_cont(s.dur_us - s.comm_us, 0.5) AS compute_p50_us,
               sum(s.comm_us) / nullif(sum(s.dur_us), 0) AS comm_share,
               any_value(m.peak_bytes) AS peak_bytes, any_value(m.state_bytes) AS state_bytes
        FROM s LEFT JOIN r USING (rank) LEFT JOIN m USING (rank)
        GROUP BY s.rank ORDER BY s.rank""", [run, run, run])


def _controller(store: Store, run: str) -> dict[str, Any] | None:
    """The controller's step (split the batch, send it, wait for every rank, take the result)
    and its overhead: that time minus the slowest rank's own step time, per step."""
    rows = _rows(store, """
        WITH c AS (SELECT step, dur_us FROM steps WHERE run_id = ? AND rank < 0),
             w AS (SELECT step, max(dur_us) AS slowest FROM steps
                   WHERE run_id = ? AND rank >= 0 GROUP BY step)
        SELECT count(*) AS steps, quantile_cont(c.dur_us, 0.5) AS step_p50_us,
               quantile_cont(c.dur_us - w.slowest, 0.5) AS overhead_p50_us
        FROM c JOIN w USING (step)""", [run, run])
    return rows[0] if rows and rows[0]["steps"] else None


def _stragglers(store: Store, run: str, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ranks whose median compute time exceeds the median over ranks by > 10%, since which
    step, and the collective in which the other ranks wait longest meanwhile."""
    computes = [r["compute_p50_us"] for r in ranks if r["compute_p50_us"] is not None]
    if len(computes) < 2:
        return []
    median = statistics.median(computes)
    slow = [r for r in ranks if r["compute_p50_us"] is not None
            and r["compute_p50_us"] > STRAGGLER_RATIO * median]
    out = []
    for r in slow:
        since, slower_since = _slow_since(store, run, r["rank"])
        wait = _rows(store, """
            SELECT kind, axis, node, avg(dur_us) AS mean_us, count(*) AS calls
            FROM collectives WHERE run_id = ? AND rank <> ? AND step >= ?
            GROUP BY kind, axis, node ORDER BY mean_us DESC, kind, axis, node LIMIT 1""",
                     [run, r["rank"], since if since is not None else -(2**62)])
        out.append({"rank": r["rank"], "host": r["host"], "compute_p50_us": r["compute_p50_us"],
                    "median_compute_us": median,
                    "slower_by": r["compute_p50_us"] / median - 1 if median else None,
                    "since_step": since, "slower_since": slower_since,
                    "others_wait_in": wait[0] if wait else None})
    return out


def _slow_since(store: Store, run: str, rank: int) -> tuple[int | None, float | None]:
    """The first step of the rank's final run of consecutive slow steps (a step is slow when
    its compute time exceeds the median over ranks of that step by > 10%), and how much slower
    it is since then (median over those steps of compute / that step's median, minus 1)."""
    rows = _rows(store, f"""
        WITH s AS (SELECT rank, step, dur_us - coalesce(comm_us, 0) AS compute
                   FROM steps WHERE run_id = ? AND rank >= 0),
             m AS (SELECT step, median(compute) AS med FROM s GROUP BY step)
        SELECT s.step, s.compute > {STRAGGLER_RATIO} * m.med AS slow,
               s.compute / nullif(m.med, 0) AS ratio
        FROM s JOIN m USING (step) WHERE s.rank = ? ORDER BY s.step""", [run, rank])
    since, ratios = None, []
    for row in reversed(rows):
        if row["slow"]:
            since = row["step"]
            ratios.append(row["ratio"])
        elif since is not None:
            break
    ratios = [x for x in ratios if x is not None]
    return since, (statistics.median(ratios) - 1 if ratios else None)


def _collectives(store: Store, run: str) -> list[dict[str, Any]]:
    """Per kind and axis, per rank per step: the plan's calls, bytes and time next to the
    measured ones. Measured from every ``collectives`` row, so calls the plan priced apart and
    the runtime merged (a gradient bucket: value ``<bucket>``) count as the runtime made them."""
    return _rows(store, """
        WITH n AS (SELECT nullif(count(*), 0) AS rank_steps FROM steps
                   WHERE run_id = ? AND rank >= 0),
             p AS (SELECT kind, axis, count(*) AS planned_calls, sum(bytes) AS predicted_bytes,
                          sum(est_us) AS predicted_us
                   FROM plan_collectives WHERE run_id = ? GROUP BY kind, axis),
             m AS (SELECT kind, axis, count(*) AS calls, sum(bytes) AS bytes,
                          sum(dur_us) AS us
                   FROM collectives WHERE run_id = ? GROUP BY kind, axis)
        SELECT kind, axis, coalesce(p.planned_calls, 0) AS planned_calls,
               coalesce(m.calls, 0) / n.rank_steps AS calls_per_step,
               p.predicted_bytes,
               coalesce(m.bytes, 0) / n.rank_steps AS measured_bytes,
               p.predicted_us,
               coalesce(m.us, 0) / n.rank_steps AS measured_us
        FROM p FULL JOIN m USING (kind, axis) CROSS JOIN n
        ORDER BY measured_us DESC NULLS LAST, kind, axis""", [run, run, run])


def _us(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v / 1e3:.2f} ms" if abs(v) >= 1e3 else f"{v:.0f} µs"


def _bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.2f} {unit}"
    return f"{v:.0f} B"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def render_summary(d: dict[str, Any]) -> Any:
    """The summary as a rich renderable (a Group of a header line and tables)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = []
    run = d.get("run") or {}
    head = f"run {d['run_id']}"
    if run:
        head += (f": {run.get('step_name') or '?'} on mesh {run.get('mesh')} "
                 f"({run.get('world_size')} ranks, {run.get('strategy')}), level {run.get('level')}"
                 f", plan estimate {_us(run.get('est_step_us'))}/step")
    parts.append(Text(head, style="bold"))

    t = Table(title="steps per rank")
    for col in ("rank", "host", "coords", "steps", "p50", "p95", "compute p50", "comm share",
                "peak"):
        t.add_column(col, justify="left" if col in ("host", "coords") else "right")
    for r in d["ranks"]:
        t.add_row(str(r["rank"]), r["host"] or "-", r["coords"] or "-", str(r["steps"]),
                  _us(r["step_p50_us"]), _us(r["step_p95_us"]), _us(r["compute_p50_us"]),
                  _pct(r["comm_share"]), _bytes(r["peak_bytes"]))
    parts.append(t)
    ctl = d.get("controller")
    if ctl:
        parts.append(Text(f"controller: step p50 {_us(ctl['step_p50_us'])} (split, send, wait, "
                          f"gather), overhead over the slowest rank p50 "
                          f"{_us(ctl['overhead_p50_us'])}"))

    if not d["stragglers"]:
        parts.append(Text("no stragglers (no rank's median compute is >10% over the median)"))
    for s in d["stragglers"]:
        line = (f"straggler: rank {s['rank']} computes {_pct(s['slower_by'])} slower than the "
                f"median ({_us(s['compute_p50_us'])} vs {_us(s['median_compute_us'])})")
        if s["since_step"] is not None:
            line += f"; since step {s['since_step']} it is {_pct(s['slower_since'])} slower"
        w = s["others_wait_in"]
        if w:
            line += (f"; the other ranks wait longest in {w['kind']} on {w['axis']} at "
                     f"{w['node']} ({_us(w['mean_us'])} mean)")
        parts.append(Text(line, style="yellow"))

    if d["collectives"]:
        c = Table(title="collectives per rank per step: plan vs measured")
        for col in ("kind", "axis", "planned calls", "calls/step", "bytes plan", "bytes measured",
                    "time plan", "time measured"):
            c.add_column(col, justify="left" if col in ("kind", "axis") else "right")
        for r in d["collectives"]:
            c.add_row(r["kind"], r["axis"], str(r["planned_calls"]),
                      "-" if r["calls_per_step"] is None else f"{r['calls_per_step']:.2f}",
                      _bytes(r["predicted_bytes"]), _bytes(r["measured_bytes"]),
                      _us(r["predicted_us"]), _us(r["measured_us"]))
        parts.append(c)

    if d["failures"]:
        f = Table(title="failures")
        for col in ("rank", "step", "kind", "error", "source"):
            f.add_column(col)
        for r in d["failures"]:
            f.add_row("controller" if r["rank"] == -1 else str(r["rank"]),
                      "-" if r["step"] is None else str(r["step"]), r["kind"] or "-",
                      r["error"] or "-", r["source"] or "-")
        parts.append(f)
    else:
        parts.append(Text("no failures"))
    return Group(*parts)
