"""``meshplan telemetry``: query, summarise and export what the ranks recorded.

``sql`` answers a query (a table, or JSON rows with ``--json``); ``summary`` shows a run's step
times, stragglers, collectives against the plan, and failures; ``trace`` writes a Chrome/Perfetto
trace; ``ingest`` loads new segments into the database. Every command reads ``--db`` (default
``$MESHPLAN_TELEMETRY`` or ``.meshplan/telemetry.duckdb``); when another process holds that
database, they read its Parquet segments instead and say so on stderr.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import decimal
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from ._cli_run import _guarded
from ._errors import TelemetryError


def add_telemetry_commands(sub: argparse._SubParsersAction) -> None:
    """Register the ``telemetry`` command group."""
    p = sub.add_parser("telemetry", help="query, summarise and export recorded runs (SQL)")
    ts = p.add_subparsers(dest="telemetry_command", required=True)

    def common(c: argparse.ArgumentParser) -> None:
        c.add_argument("--db", help="the telemetry database (default: $MESHPLAN_TELEMETRY or "
                       ".meshplan/telemetry.duckdb)")
        c.add_argument("--debug", action="store_true", help="show the traceback of a failure")

    q = ts.add_parser("sql", help="run a SQL query over the tables (see telemetry/SCHEMA.md)")
    q.add_argument("query", help='e.g. "SELECT rank, avg(dur_us) FROM steps GROUP BY rank"')
    q.add_argument("--json", action="store_true", help="print the rows as a JSON list of objects")
    q.add_argument("--max-rows", type=int, default=200, help="rows shown in the table view")
    common(q)
    q.set_defaults(func=_guarded(cmd_sql))

    s = ts.add_parser("summary", help="step times per rank, stragglers, plan vs measured")
    s.add_argument("--run", help="run id (default: the latest run)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    common(s)
    s.set_defaults(func=_guarded(cmd_summary))

    t = ts.add_parser("trace", help="write a run as a Chrome/Perfetto trace JSON")
    t.add_argument("--out", "-o", required=True, help="where to write the trace (atomically)")
    t.add_argument("--run", help="run id (default: the latest run)")
    common(t)
    t.set_defaults(func=_guarded(cmd_trace))

    i = ts.add_parser("ingest", help="load new Parquet segments into the database")
    i.add_argument("--json", action="store_true", help="what was loaded and skipped, as JSON")
    common(i)
    i.set_defaults(func=_guarded(cmd_ingest))

    v = sub.add_parser("serve", help="the telemetry store, runs and plans over HTTP for agents "
                                     "and tools (read-only, token required)")
    v.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: loopback only)")
    v.add_argument("--port", type=int, default=None,
                   help="port (default 8765; 0: any free port, printed)")
    v.add_argument("--token", help="the bearer token every request must send (default: "
                                   "$MESHPLAN_TOKEN, else a new one, printed)")
    v.add_argument("--plans", help="a folder of plan files to serve at /v1/plans")
    common(v)
    v.set_defaults(func=_guarded(cmd_serve))

    tp = sub.add_parser("top", help="a running job's ranks, stragglers, memory and "
                                    "collectives, refreshed (from its telemetry)")
    tp.add_argument("--run", help="run id (default: the latest run)")
    tp.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    tp.add_argument("--window", type=int, default=20, help="the last steps it looks at")
    tp.add_argument("--once", action="store_true", help="print one view and exit")
    tp.add_argument("--json", action="store_true", help="one view as JSON, then exit")
    common(tp)
    tp.set_defaults(func=_guarded(cmd_top))

    mc = sub.add_parser("mcp", help="the tools of `meshplan serve` as an MCP server on stdio "
                                    "(for agents; needs meshplan[agents])")
    mc.add_argument("--plans", help="a folder of plan files to serve")
    common(mc)
    mc.set_defaults(func=_guarded(cmd_mcp))


def _quiet_store_log() -> None:
    """The commands say themselves where they read from and what they skipped, once."""
    logging.getLogger("meshplan.telemetry").setLevel(logging.ERROR)


def _open(args: argparse.Namespace, *, must_exist: bool = True, quiet: bool = False) -> Any:
    from .telemetry._schema import default_db_path, segments_dir
    from .telemetry._store import Store

    _quiet_store_log()
    db = Path(args.db) if args.db else default_db_path()
    if must_exist and not db.exists() and not segments_dir(db).exists():
        raise TelemetryError(f"no telemetry database at {db} and no segments at "
                             f"{segments_dir(db)}; run a step with telemetry on, or pass --db")
    store = Store.open(db)
    if quiet:
        return store
    if store.fallback:
        print(f"reading {store.source}", file=sys.stderr, flush=True)
    for path, why in store.skipped:
        print(f"skipped unreadable segment {path} ({why})", file=sys.stderr, flush=True)
    return store


def json_safe(v: Any) -> Any:
    """A query value as JSON: NaN/inf -> null, dates ISO 8601, decimals floats, bytes base64."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, (datetime.date, datetime.time, datetime.datetime)):
        return v.isoformat()
    if isinstance(v, datetime.timedelta):
        return v.total_seconds()
    if isinstance(v, decimal.Decimal):
        return float(v)
    if isinstance(v, bytes):
        return base64.b64encode(v).decode()
    if isinstance(v, dict):
        return {str(k): json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    if v is None or isinstance(v, (bool, int, str)):
        return v
    return str(v)


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)


def cmd_sql(args: argparse.Namespace) -> int:
    with _open(args) as store:
        table = store.sql(args.query)
    rows = table.to_pylist()
    if args.json:
        print(json.dumps(json_safe(rows), allow_nan=False))
        return 0
    from rich.table import Table

    out = Table(show_lines=False)
    for name in table.column_names:
        out.add_column(name)
    for r in rows[:args.max_rows]:
        out.add_row(*("NULL" if v is None else str(v) for v in r.values()))
    console = _console()
    console.print(out)
    more = f"; {len(rows) - args.max_rows} not shown (--max-rows, or --json for all)" \
        if len(rows) > args.max_rows else ""
    console.print(f"{len(rows)} rows{more}")
    return 0


def cmd_summary(args: argparse.Namespace) -> int:
    from .telemetry._summary import render_summary, summary

    with _open(args) as store:
        d = summary(store, args.run)
    if args.json:
        print(json.dumps(json_safe(d), indent=2, allow_nan=False))
    else:
        _console().print(render_summary(d))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from .telemetry._top import render_top, top

    if args.interval <= 0 or args.window < 1:
        raise TelemetryError("--interval must be above 0 and --window at least 1")

    def view(quiet: bool) -> dict[str, Any]:
        with _open(args, quiet=quiet) as store:
            return top(store, args.run, args.window)

    if args.json:
        print(json.dumps(json_safe(view(False)), indent=2, allow_nan=False))
        return 0
    console = _console()
    if args.once:
        console.print(render_top(view(False)))
        return 0
    if not console.is_terminal:      # a file or a pipe: one view after another
        try:
            while True:
                console.print(render_top(view(True)))
                console.file.flush()
                time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0
    from rich.live import Live

    try:
        with Live(render_top(view(False)), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(render_top(view(True)), refresh=True)
    except KeyboardInterrupt:
        return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from .telemetry._trace import write_trace

    with _open(args) as store:
        n = write_trace(store, args.out, args.run)
    print(f"wrote {n} trace events to {args.out}; open it in https://ui.perfetto.dev")
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    from .telemetry._schema import default_db_path
    from .telemetry._store import Store

    from .telemetry._recorder import recover_journals

    _quiet_store_log()
    db = Path(args.db) if args.db else default_db_path()
    with Store.open(db, ingest=False) as store:
        if store.fallback:
            raise TelemetryError(f"cannot ingest: {store.source}; close that process first")
        # the journals of ranks a killed controller's run left (its processes gone)
        rescued = sum(recover_journals(run, gone_here=True)
                      for run in sorted(store.segments.glob("*")) if run.is_dir())
        if rescued:
            print(f"recovered {rescued} rows from the journals of ranks that died before "
                  "their last flush", file=sys.stderr, flush=True)
        r = store.ingest()
    if args.json:
        print(json.dumps({"db": str(db), "rows": r.rows, "segments": r.segments,
                          "recovered_rows": rescued,
                          "skipped": [{"path": str(p), "why": w} for p, w in r.skipped]}))
        return 0
    for path, why in r.skipped:
        print(f"skipped unreadable segment {path} ({why})", file=sys.stderr, flush=True)
    print(f"ingested {r.rows} rows from {r.segments} segments into {db}"
          + (f"; skipped {len(r.skipped)} unreadable segments" if r.skipped else ""))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """``meshplan serve``: open the store, print the address and token, answer until
    interrupted (``_serve.py``)."""
    from ._serve import DEFAULT_PORT, TOKEN_ENV, make_server

    store = _open(args, must_exist=False)
    port = DEFAULT_PORT if args.port is None else args.port
    server, service = make_server(store, host=args.host, port=port, token=args.token,
                                  plans=args.plans)
    host, port = server.server_address[:2]
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"meshplan serve: listening on {host}, not loopback: the token and the data "
              "travel without TLS", file=sys.stderr, flush=True)
    generated = not args.token and not os.environ.get(TOKEN_ENV)
    told = f"  token: {service.token}\n" if generated else ""
    print(f"meshplan serve: http://{host}:{port} ({store.source})\n{told}"
          f"  try: curl -H 'Authorization: Bearer TOKEN' http://{host}:{port}/SKILL.md",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        store.close()
    return 0


def cmd_mcp(args: argparse.Namespace) -> int:
    """``meshplan mcp``: the store's tools over stdio (``_mcp.py``); stdout is the
    protocol's, so everything else goes to stderr."""
    from ._mcp import run_stdio

    store = _open(args, must_exist=False)
    try:
        run_stdio(store, args.plans)
    finally:
        store.close()
    return 0
