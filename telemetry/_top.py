"""``meshplan top``: a running job's ranks at a glance, refreshed (README, "Live debugging").

``top(store)`` returns the latest run's (or ``run_id``'s) last ``window`` steps as plain
JSON-safe values: the run, its progress (latest step, steps per second), every rank's step
and compute times, communication share, memory and how far it is behind, the ranks slower
than the others (stragglers: median compute time over the window above 1.10x the median over
ranks), the collectives that took the most time, and the latest failures, recoveries and
stack dump. ``render_top(d)`` turns it into rich tables. The ranks write their rows every
``TelemetryConfig.flush_interval_s``, so what ``top`` shows is that old at most.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Any

from ._store import Store
from ._summary import STRAGGLER_RATIO, _rows, resolve_run

WINDOW = 20         # steps a refresh looks at


def _alive(host: str | None, pid: int | None) -> bool | None:
    """Whether the run's controller process still runs (None: on another host, unknown)."""
    if not pid or host != socket.gethostname():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def top(store: Store, run_id: str | None = None, window: int = WINDOW) -> dict[str, Any]:
    run = resolve_run(store, run_id)
    info = _rows(store, "SELECT step_name, mesh, world_size, strategy, level, host, pid, "
                        "start_us FROM runs WHERE run_id = ? ORDER BY start_us LIMIT 1", [run])
    info = info[0] if info else {}
    last = _rows(store, "SELECT max(step) AS step FROM steps WHERE run_id = ? AND rank >= 0",
                 [run])[0]["step"]
    first = None if last is None else max(0, last - window + 1)
    pace = _rows(store, """
        SELECT count(*) AS steps, min(start_us) AS t0, max(start_us + dur_us) AS t1,
               quantile_cont(dur_us, 0.5) AS step_p50_us
        FROM steps WHERE run_id = ? AND rank < 0 AND step >= ?""", [run, first or 0])[0]
    span = (pace["t1"] - pace["t0"]) / 1e6 if pace["steps"] and pace["t1"] else None
    ranks = _rows(store, """
        WITH s AS (SELECT rank, step, dur_us, coalesce(comm_us, 0) AS comm_us
                   FROM steps WHERE run_id = ? AND rank >= 0 AND step >= ?),
             l AS (SELECT rank, max(step) AS last_step, arg_max(dur_us, step) AS last_us
                   FROM steps WHERE run_id = ? AND rank >= 0 GROUP BY rank),
             m AS (SELECT rank, max(peak_bytes) AS peak_bytes,
                          arg_max(allocated_bytes, step) AS allocated_bytes,
                          arg_max(state_bytes, step) AS state_bytes
                   FROM memory WHERE run_id = ? GROUP BY rank),
             h AS (SELECT rank, any_value(host) AS host FROM ranks WHERE run_id = ?
                   GROUP BY rank)
        SELECT l.rank, any_value(h.host) AS host, any_value(l.last_step) AS last_step,
               any_value(l.last_us) AS last_us,
               quantile_cont(s.dur_us, 0.5) AS step_p50_us,
               quantile_cont(s.dur_us - s.comm_us, 0.5) AS compute_p50_us,
               sum(s.comm_us) / nullif(sum(s.dur_us), 0) AS comm_share,
               any_value(m.peak_bytes) AS peak_bytes,
               any_value(m.allocated_bytes) AS allocated_bytes,
               any_value(m.state_bytes) AS state_bytes
        FROM l LEFT JOIN s USING (rank) LEFT JOIN m USING (rank) LEFT JOIN h USING (rank)
        GROUP BY l.rank ORDER BY l.rank""", [run, first or 0, run, run, run])
    computes = [r["compute_p50_us"] for r in ranks if r["compute_p50_us"] is not None]
    median = statistics.median(computes) if computes else None
    for r in ranks:
        r["behind"] = None if last is None or r["last_step"] is None else last - r["last_step"]
        r["straggler"] = bool(median and len(computes) > 1 and r["compute_p50_us"] is not None
                              and r["compute_p50_us"] > STRAGGLER_RATIO * median)
        r["slower_by"] = (r["compute_p50_us"] / median - 1
                          if median and r["compute_p50_us"] is not None else None)
    collectives = _rows(store, """
        SELECT kind, axis, count(*) AS calls, sum(bytes) AS bytes, avg(dur_us) AS mean_us,
               max(dur_us) AS max_us, sum(dur_us) AS total_us
        FROM collectives WHERE run_id = ? AND step >= ?
        GROUP BY kind, axis ORDER BY total_us DESC, kind, axis LIMIT 6""", [run, first or 0])
    failures = _rows(store, "SELECT rank, time_us, step, kind, error FROM failures "
                            "WHERE run_id = ? ORDER BY time_us DESC, rank LIMIT 5", [run])
    recoveries = _rows(store, "SELECT count(*) AS n FROM recoveries WHERE run_id = ?",
                       [run])[0]["n"]
    dump = _rows(store, """
        SELECT rank, time_us, reason, doing, frame FROM stacks
        WHERE run_id = ? AND time_us = (SELECT max(time_us) FROM stacks WHERE run_id = ?)
        ORDER BY rank""", [run, run])
    return {"run_id": run, "run": info, "controller_alive": _alive(info.get("host"),
                                                                   info.get("pid")),
            "window": window, "latest_step": last,
            "steps_per_s": (pace["steps"] / span) if span else None,
            "controller_step_p50_us": pace["step_p50_us"], "ranks": ranks,
            "median_compute_us": median, "collectives": collectives,
            "failures": failures, "recoveries": recoveries, "stacks": dump,
            "at_us": int(time.time() * 1e6)}


def _ms(us: Any) -> str:
    return "-" if us is None else f"{us / 1000:.1f}"


def _bytes(b: Any) -> str:
    if b is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return str(b)


def _short(b: Any) -> str:
    """Bytes in a few characters: ``228M``, ``1.2G``."""
    if b is None:
        return "-"
    for unit in ("B", "K", "M", "G", "T"):
        if abs(b) < 1024 or unit == "T":
            return f"{b:.0f}{unit}" if b >= 100 or unit == "B" else f"{b:.1f}{unit}"
        b /= 1024
    return str(b)


def render_top(d: dict[str, Any]) -> Any:
    from rich import box
    from rich.console import Group
    from rich.table import Table as _Table
    from rich.text import Text

    def Table(**kw: Any) -> Any:  # noqa: N802 - compact tables: a terminal is often 80 wide
        return _Table(box=box.SIMPLE_HEAD, padding=(0, 1), **kw)

    run = d["run"] or {}
    alive = {True: "running", False: "ended", None: "controller on another host"}[
        d["controller_alive"]]
    rate = f"{d['steps_per_s']:.2f} steps/s" if d["steps_per_s"] else "-"
    head = Text(f"run {d['run_id']}  {run.get('step_name', '?')}  mesh {run.get('mesh', '?')} "
                f"({run.get('world_size', '?')} ranks, {run.get('strategy', '?')})  {alive}\n"
                f"latest step {d['latest_step']}  {rate}  controller step p50 "
                f"{_ms(d['controller_step_p50_us'])} ms  (last {d['window']} steps)",
                style="bold")
    ranks = Table(title="ranks (times in ms; comm: the step's share in collectives)",
                  title_justify="left")
    hosts = len({r["host"] for r in d["ranks"]}) > 1
    for col in ("rank", *(("host",) if hosts else ()), "step", "last", "p50", "compute",
                "comm", "mem", "peak", ""):
        ranks.add_column(col, justify="left" if col in ("host", "") else "right",
                         no_wrap=True)
    for r in d["ranks"]:
        flags = []
        if r["straggler"]:
            flags.append(f"slow +{r['slower_by'] * 100:.0f}%")
        if r["behind"]:
            flags.append(f"{r['behind']} behind")
        ranks.add_row(str(r["rank"]), *((r["host"] or "-",) if hosts else ()),
                      str(r["last_step"]), _ms(r["last_us"]), _ms(r["step_p50_us"]),
                      _ms(r["compute_p50_us"]),
                      "-" if r["comm_share"] is None else f"{r['comm_share'] * 100:.0f}%",
                      _short(r["allocated_bytes"]), _short(r["peak_bytes"]),
                      Text(", ".join(flags), style="bold red") if flags else "")
    parts: list[Any] = [head, ranks]
    if d["collectives"]:
        coll = Table(title="collectives (most time first)", title_justify="left")
        for col in ("kind", "axis", "calls", "bytes", "mean ms", "max ms", "total ms"):
            coll.add_column(col, justify="left" if col in ("kind", "axis") else "right")
        for c in d["collectives"]:
            coll.add_row(c["kind"], c["axis"] or "-", str(c["calls"]), _bytes(c["bytes"]),
                         _ms(c["mean_us"]), _ms(c["max_us"]), _ms(c["total_us"]))
        parts.append(coll)
    if d["failures"] or d["recoveries"]:
        fail = Table(title=f"failures (latest first; {d['recoveries']} recoveries)",
                     title_justify="left")
        for col in ("ranks", "step", "kind", "error"):
            fail.add_column(col)
        same: dict[tuple, list[int]] = {}
        for f in d["failures"]:
            line = (f["error"] or "").splitlines()[0][:160] if f["error"] else ""
            same.setdefault((f["step"], f["kind"], line), []).append(f["rank"])
        for (step, kind, line), who in same.items():
            fail.add_row(",".join(map(str, sorted(who))), str(step), kind, line)
        parts.append(fail)
    if d["stacks"]:
        st = Table(title=f"latest stacks ({d['stacks'][0]['reason']}; telemetry table "
                         "stacks)", title_justify="left")
        for col in ("rank", "doing", "frame"):
            st.add_column(col)
        for s in d["stacks"]:
            st.add_row(str(s["rank"]), s["doing"] or "", s["frame"] or "")
        parts.append(st)
    return Group(*parts)
