"""``meshplan serve``: the telemetry store, the runs and the plans over HTTP, for agents and
tools (issue 25, point 3).

    meshplan serve [--host 127.0.0.1] [--port 8765] [--token T] [--db PATH] [--plans DIR]

Every request needs ``Authorization: Bearer T`` (the token given, else ``$MESHPLAN_TOKEN``,
else one generated and printed at start); a missing or wrong one is a 401. The API is read-only:

- ``GET /SKILL.md``: how to use the data (schema first, then example queries), for an agent.
- ``GET /v1/openapi.json``: this API as an OpenAPI 3.1 document.
- ``GET /v1/schema``: every table and view with its columns and types.
- ``POST /v1/query`` ``{"sql": ..., "max_rows": 1000, "timeout_s": 30, "live_timeout_s": 3}``:
  one statement (``SELECT``, ``WITH``, ``DESCRIBE``, ``SHOW``, ``SUMMARIZE``, ``EXPLAIN``) over
  the store and the live workers: ``live_<table>`` (``live_steps``, ``live_collectives``, ...)
  is every running rank's recent rows of ``<table>`` held in its memory now (flushed or not),
  asked of the ranks of every run whose controller runs on this host (``runtime/_live.py``)
  within ``live_timeout_s``; the answer's ``live`` says which runs and ranks answered.
  Anything that writes (``INSERT``, ``CREATE``, ``COPY``, ``ATTACH``, ``SET``, ...) is refused
  before it runs (403), and the connection cannot read or write files, attach databases or load
  extensions (``telemetry/_sandbox.py``: ``read_csv``, ``COPY ... TO`` are DuckDB's own permission errors,
  also 403). At most ``max_rows`` rows come back (``truncated`` says when there were more); a
  query still running at ``timeout_s`` is interrupted (408).
- ``GET /v1/runs``: every recorded run with its steps, failures, recoveries, whether its
  last failure was recovered from, and whether it runs now (``live``).
- ``GET /v1/runs/RUN_ID/stacks[?timeout_s=3]``: a running run's Python stacks, every rank's,
  now (its ranks' side threads answer while they compute or wait; 404 when it does not run).
- ``GET /v1/plans``, ``GET /v1/plans/NAME``, ``GET /v1/plans/NAME/explain[?node=N]``: the plan
  files (``.plan``, ``.json``) of ``--plans DIR`` (no other path is read), shown and explained
  as ``meshplan plan show --json`` / ``plan explain --json`` print them.

Errors are JSON: ``{"error": {"type": ..., "message": ...}}`` with ``type`` one of
``unauthorized`` (401), ``bad_request`` (400), ``bad_sql`` (400), ``refused`` (403),
``not_found`` (404), ``method_not_allowed`` (405), ``timeout`` (408), ``too_large`` (413),
``internal`` (500).

The store is opened once (``Store.open``: when a running job's controller holds the database,
its finished segments are read directly instead) and new segments are ingested at most every
``REFRESH_S`` seconds before a query: a running job's rows appear in its tables as its ranks
flush them (every 2 s), and in the ``live_`` tables at once. Queries run one at a time. Live
workers are reached where their controller runs on this host. No TLS: bind to loopback (the
default) or put it behind a proxy that terminates TLS.
"""

from __future__ import annotations

import hmac
import json
import math
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from ._errors import MeshplanError, TelemetryError
from .runtime._live import DEFAULT_ASK_S, MAX_ASK_S, LiveClient, LiveError
from .telemetry._schema import TABLES, VIEWS

DEFAULT_PORT = 8765
TOKEN_ENV = "MESHPLAN_TOKEN"
MAX_ROWS = 100_000                 # the most rows one query may ask for
DEFAULT_ROWS = 1_000
DEFAULT_TIMEOUT_S = 30.0
MAX_BODY = 1 << 20                 # bytes of a request body
REFRESH_S = 5.0
PLAN_SUFFIXES = (".plan", ".json")
_READ_ONLY = ("SELECT", "EXPLAIN")         # DuckDB's statement types a query may be
LIVE_PREFIX = "live_"                      # live_<table>: the running ranks' rows


class ApiError(Exception):
    """An answer other than 200: its HTTP status, its ``type`` and what to do."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message

    def body(self) -> dict[str, Any]:
        return {"error": {"type": self.kind, "message": self.message}}


@dataclass
class Service:
    """What the server answers, without HTTP: ``handle`` takes a request's method, path,
    headers and body and returns ``(status, content type, body bytes)``."""

    store: Any                          # telemetry._store.Store
    token: str
    plans: Path | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _refreshed: float = field(default_factory=time.monotonic)

    def handle(self, method: str, target: str, headers: Any, body: bytes) -> tuple[int, str, bytes]:
        try:
            self._authorize(headers.get("Authorization"))
            url = urlsplit(target)
            path = url.path.rstrip("/") or "/"
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            if path == "/SKILL.md":
                self._method(method, "GET", path)
                return 200, "text/markdown; charset=utf-8", skill().encode()
            if path == "/v1/query":
                self._method(method, "POST", path)
                return _json(self.query(**_query_args(body)))
            self._method(method, "GET", path)
            if path == "/v1/openapi.json":
                return _json(openapi())
            if path == "/v1/schema":
                return _json(schema())
            if path == "/v1/runs":
                return _json(self.runs())
            if path == "/v1/plans":
                return _json({"plans": [p.name for p in self._plan_files()]})
            parts = path.split("/")
            if len(parts) == 5 and parts[:3] == ["", "v1", "runs"] and parts[4] == "stacks":
                return _json(self.stacks(unquote(parts[3]), _seconds(query, "timeout_s")))
            if len(parts) in (4, 5) and parts[:3] == ["", "v1", "plans"]:
                name = unquote(parts[3])
                if len(parts) == 4:
                    return _json(self.plan_show(name))
                if parts[4] == "explain":
                    return _json(self.plan_explain(name, query.get("node")))
            raise ApiError(404, "not_found", f"no {path}: GET /v1/openapi.json lists the paths")
        except ApiError as e:
            return _json(e.body(), e.status)
        except Exception as e:     # a bug here must not kill the server: said as a 500
            return _json(ApiError(500, "internal", f"{type(e).__name__}: {e}").body(), 500)

    # ---- requests ---------------------------------------------------------------------------

    def _authorize(self, header: str | None) -> None:
        scheme, _, given = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 self.token.encode()):
            raise ApiError(401, "unauthorized",
                           "missing or wrong token: send 'Authorization: Bearer TOKEN' with the "
                           "token meshplan serve printed (or was given)")

    @staticmethod
    def _method(method: str, want: str, path: str) -> None:
        if method != want:
            raise ApiError(405, "method_not_allowed", f"{method} {path}: use {want}")

    def query(self, sql: str, max_rows: int = DEFAULT_ROWS,
              timeout_s: float = DEFAULT_TIMEOUT_S,
              live_timeout_s: float = DEFAULT_ASK_S) -> dict[str, Any]:
        """One read-only statement: its columns, at most ``max_rows`` rows, and whether more
        were left out; with ``live_`` tables, also which runs and ranks gave their rows."""
        _check_read_only(sql)
        self._refresh()
        live = _live_tables(sql)
        fetched, report = self._live_rows(sorted(live.values()), live_timeout_s) \
            if live else ({}, None)
        # one query at a time on the store's own connection: a cursor would not see the
        # datasets a store reading segments registered on it (they are per connection)
        with self._lock:
            con = self.store._con
            for name, table in live.items():
                con.register(name, fetched[table])
            try:
                answer = self._run(sql, max_rows, timeout_s)
            finally:
                for name in live:
                    con.unregister(name)
        if report is not None:
            answer["live"] = report
        return answer

    def _live_rows(self, tables: list[str], timeout_s: float
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Every live run's ranks' recent rows of ``tables``, put together per table, and
        what answered: ``{"runs": [{"run_id", "answered", "missing", "errors"}],
        "unreachable": [{"run_id", "why"}]}``."""
        import pyarrow as pa

        parts: dict[str, list[Any]] = {t: [] for t in tables}
        runs, unreachable = [], []
        for client in LiveClient.find(self.store.segments):
            try:
                got, meta = client.rows(tables, timeout_s)
            except LiveError as e:
                if e.status:          # a controller that ended is no news: it is not live
                    unreachable.append({"run_id": client.run_id, "why": str(e)})
                continue
            runs.append(meta)
            for table in tables:
                parts[table].append(got[table])
        return ({t: pa.concat_tables(parts[t], promote_options="permissive") if parts[t]
                 else TABLES[t].empty_table() for t in tables},
                {"runs": runs, "unreachable": unreachable})

    def live_runs(self) -> dict[str, LiveClient]:
        """The runs whose controller answers on this host now, with running ranks."""
        live = {}
        for client in LiveClient.find(self.store.segments):
            try:
                if client.status().get("running"):
                    live[client.run_id] = client
            except (LiveError, ValueError):
                pass
        return live

    def stacks(self, run_id: str, timeout_s: float | None) -> dict[str, Any]:
        world = None
        for client in LiveClient.find(self.store.segments):
            if client.run_id == run_id:
                try:
                    status = client.status()
                except (LiveError, ValueError):
                    continue
                if status.get("running"):
                    world = status.get("world") or 0
                    break
        if world is None:
            raise ApiError(404, "not_found", f"run {run_id!r} is not running with its "
                                             "controller on this host (GET /v1/runs: live)")
        try:
            got = client.stacks(DEFAULT_ASK_S if timeout_s is None else timeout_s)
        except LiveError as e:
            raise ApiError(404 if e.status in (0, 503) else 500,
                           "not_found" if e.status in (0, 503) else "internal", str(e)) from None
        return {"run_id": run_id, "stacks": got,
                "missing": [r for r in range(world) if str(r) not in got]}

    def _run(self, sql: str, max_rows: int, timeout_s: float) -> dict[str, Any]:
        import duckdb

        con = self.store._con
        done = threading.Event()

        def stop() -> None:
            if not done.wait(timeout_s):
                con.interrupt()
        threading.Thread(target=stop, daemon=True, name="meshplan-serve-timeout").start()
        try:
            rel = con.sql(sql)
            table = rel.limit(max_rows + 1).to_arrow_table() if rel is not None else None
        except duckdb.InterruptException:
            raise ApiError(408, "timeout", f"the query ran past timeout_s={timeout_s:g} and "
                                           "was interrupted; narrow it, or raise timeout_s")
        except duckdb.PermissionException as e:
            raise ApiError(403, "refused", f"{_first_line(e)} (this API reads the store's "
                                           "tables and views only)")
        except duckdb.Error as e:
            raise ApiError(400, "bad_sql", f"{_first_line(e)} (GET /v1/schema lists the "
                                           "tables and their columns)")
        finally:
            done.set()
        if table is None:
            return {"columns": [], "rows": [], "row_count": 0, "truncated": False}
        from ._cli_telemetry import json_safe

        rows = [list(r.values()) for r in table.slice(0, max_rows).to_pylist()]
        return {"columns": [{"name": f.name, "type": str(f.type)} for f in table.schema],
                "rows": json_safe(rows), "row_count": len(rows),
                "truncated": table.num_rows > max_rows}

    def runs(self) -> dict[str, Any]:
        got = self.query(_RUNS_SQL, max_rows=MAX_ROWS)
        names = [c["name"] for c in got["columns"]]
        runs = [dict(zip(names, r)) for r in got["rows"]]
        live = self.live_runs()
        for r in runs:
            r["recovered"] = bool(r["failures"] == 0 or (r["last_recovery_us"] or -1) >=
                                  (r["last_failure_us"] or 0))
            r["live"] = r["run_id"] in live
        return {"runs": runs}

    def plan_show(self, name: str) -> dict[str, Any]:
        from ._cli_plan import show_data

        return _plan_call(show_data, self._plan_file(name))

    def plan_explain(self, name: str, node: str | None) -> dict[str, Any]:
        from ._cli_plan import explain_data

        return _plan_call(lambda p: explain_data(p, node), self._plan_file(name))

    # ---- internals --------------------------------------------------------------------------

    def _refresh(self) -> None:
        """New segments into the store, at most every ``REFRESH_S`` (the database's holder
        only: a store reading segments directly shows those of its opening)."""
        if self.store.fallback or time.monotonic() - self._refreshed < REFRESH_S:
            return
        with self._lock:
            self._refreshed = time.monotonic()
            self.store.ingest()

    def _plan_files(self) -> list[Path]:
        if self.plans is None:
            raise ApiError(404, "not_found", "no plans are served: start meshplan serve with "
                                             "--plans DIR")
        return sorted(p for p in self.plans.iterdir()
                      if p.is_file() and p.suffix in PLAN_SUFFIXES)

    def _plan_file(self, name: str) -> Path:
        files = {p.name: p for p in self._plan_files()}
        if name not in files:
            raise ApiError(404, "not_found", f"no plan {name!r} in {self.plans} (GET /v1/plans "
                                             "lists them)")
        return files[name]


_RUNS_SQL = """
SELECT r.run_id, r.step_name, r.mesh, r.world_size, r.strategy, r.topology, r.start_us,
       r.est_step_us, r.host, r.meshplan_version,
       (SELECT count(DISTINCT s.step) FROM steps s WHERE s.run_id = r.run_id) AS steps,
       (SELECT max(s.start_us + s.dur_us) FROM steps s WHERE s.run_id = r.run_id)
           AS last_step_end_us,
       (SELECT count(*) FROM failures f WHERE f.run_id = r.run_id) AS failures,
       (SELECT max(f.time_us) FROM failures f WHERE f.run_id = r.run_id) AS last_failure_us,
       (SELECT count(*) FROM recoveries c WHERE c.run_id = r.run_id) AS recoveries,
       (SELECT max(c.time_us) FROM recoveries c WHERE c.run_id = r.run_id) AS last_recovery_us
FROM runs r ORDER BY r.start_us"""


def _check_read_only(sql: str) -> None:
    import duckdb

    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as e:
        raise ApiError(400, "bad_sql", _first_line(e)) from None
    if len(statements) != 1:
        raise ApiError(400, "bad_sql", f"give one statement, not {len(statements)}")
    kind = statements[0].type.name
    if kind not in _READ_ONLY:
        raise ApiError(403, "refused", f"{kind} is not allowed: this API is read-only (SELECT, "
                                       "WITH, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN)")


def _live_tables(sql: str) -> dict[str, str]:
    """The ``live_<table>`` names in ``sql``: ``{name: table}``. Read from the
    text (DuckDB's ``get_table_names`` binds, and fails on a join ``USING`` a column of a
    table that is not there yet); a name that only appears in a string costs a fetch."""
    return {m.group(0).lower(): m.group(1).lower() for m in _LIVE_NAME.finditer(sql)
            if m.group(1).lower() in TABLES}


_LIVE_NAME = re.compile(rf"\b{LIVE_PREFIX}([A-Za-z_]\w*)\b", re.IGNORECASE)


def _seconds(query: dict[str, str], name: str) -> float | None:
    if name not in query:
        return None
    try:
        value = float(query[name])
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_ASK_S:
        raise ApiError(400, "bad_request", f"{name}={query[name]!r}: give seconds in (0, "
                                           f"{MAX_ASK_S:g}]")
    return value


def _query_args(body: bytes) -> dict[str, Any]:
    try:
        args = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, "bad_request", f"the body is not JSON ({e})") from None
    if not isinstance(args, dict) or not isinstance(args.get("sql"), str):
        raise ApiError(400, "bad_request", 'send {"sql": "SELECT ...", "max_rows": 1000, '
                                           '"timeout_s": 30} (max_rows and timeout_s optional)')
    extra = set(args) - {"sql", "max_rows", "timeout_s", "live_timeout_s"}
    if extra:
        raise ApiError(400, "bad_request", f"unknown fields {sorted(extra)}: the body takes "
                                           "sql, max_rows, timeout_s and live_timeout_s")
    rows, timeout = args.get("max_rows", DEFAULT_ROWS), args.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= MAX_ROWS:
        raise ApiError(400, "bad_request", f"max_rows={rows!r}: give an int from 1 to {MAX_ROWS}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not 0 < timeout <= 600:
        raise ApiError(400, "bad_request", f"timeout_s={timeout!r}: give seconds in (0, 600]")
    live = args.get("live_timeout_s", DEFAULT_ASK_S)
    if isinstance(live, bool) or not isinstance(live, (int, float)) or not 0 < live <= MAX_ASK_S:
        raise ApiError(400, "bad_request", f"live_timeout_s={live!r}: give seconds in (0, "
                                           f"{MAX_ASK_S:g}]")
    return {"sql": args["sql"], "max_rows": rows, "timeout_s": float(timeout),
            "live_timeout_s": float(live)}


def _plan_call(fn: Any, path: Path) -> dict[str, Any]:
    try:
        return fn(str(path))
    except MeshplanError as e:
        raise ApiError(400, "bad_request", str(e)) from None


def _first_line(e: BaseException) -> str:
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip())


def _json(body: Any, status: int = 200) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(body, allow_nan=False).encode()


def schema() -> dict[str, Any]:
    return {"tables": {name: [{"name": f.name, "type": str(f.type)} for f in s]
                       for name, s in TABLES.items()},
            "views": {name: " ".join(sql.split()) for name, sql in VIEWS.items()}}


def skill() -> str:
    """``/SKILL.md``: the guide for an agent, with every table's columns."""
    tables = "\n".join(f"- `{name}`: {', '.join(f.name for f in s)}" for name, s in TABLES.items())
    views = "\n".join(f"- `{name}`" for name in VIEWS)
    return _SKILL.format(tables=tables, views=views)


_SKILL = """# meshplan telemetry: a skill for agents

meshplan runs a PyTorch training step on a mesh of ranks, and every rank records what it did
into a SQL store (DuckDB). This server answers read-only questions about it. Send
`Authorization: Bearer TOKEN` with every request.

## Work schema-first
1. `GET /v1/schema`: the tables, their columns and types, and the views.
2. `GET /v1/runs`: the runs recorded, newest last, with their steps and failures.
3. `POST /v1/query` with `{{"sql": "...", "max_rows": 1000, "timeout_s": 30,
   "live_timeout_s": 3}}` (all but `sql` optional): one read-only statement. Filter by `run_id` (most tables hold every run). Times are microseconds
   (`*_us`), sizes bytes.

## Live runs
A run whose controller runs on this host now is `"live": true` in `/v1/runs`. Its ranks'
rows reach the tables within a few seconds; for what they hold this very moment, read
`live_<table>` (`live_steps`, `live_collectives`, `live_memory`, ...: the same columns, the
last rows each running rank keeps in memory, of every live run). The answer's `live` names
the runs and ranks that answered (`missing`: a rank that did not within `live_timeout_s`,
default 3 s: stopped, or stuck in C code). `GET /v1/runs/RUN_ID/stacks` gives every rank's
Python stacks now, for a run that seems stuck (`doing` says what the rank was asked to do).

## Tables
{tables}

Views:
{views}

## Example queries
- Step time per rank of the last run, slowest first:
  `SELECT rank, median(dur_us) AS p50_us, max(dur_us) AS max_us FROM steps WHERE run_id =
  (SELECT run_id FROM runs ORDER BY start_us DESC LIMIT 1) GROUP BY rank ORDER BY p50_us DESC`
- The loss curve: `SELECT step, avg(loss) FROM steps WHERE run_id = '...' GROUP BY step
  ORDER BY step`
- Collectives that took longest against the plan's estimate:
  `SELECT node, kind, axis, predicted_us, measured_us FROM collectives_vs_plan
  WHERE run_id = '...' ORDER BY measured_us - predicted_us DESC LIMIT 10`
- Why a run failed: `SELECT rank, step, kind, error, source FROM failures WHERE run_id = '...'`
- Peak memory per rank: `SELECT rank, max(peak_bytes) FROM memory GROUP BY rank`
- Where each rank of the running jobs is now, and its last step's time:
  `SELECT run_id, rank, max(step) AS step, arg_max(dur_us, step) AS last_us FROM live_steps
  GROUP BY ALL ORDER BY step, last_us DESC`

## Errors
JSON `{{"error": {{"type": ..., "message": ...}}}}`: `bad_sql` (fix the statement; the message
is DuckDB's), `refused` (a write, or a file read: not allowed here), `timeout` (narrow the
query), `unauthorized`, `not_found`, `bad_request`.

## Plans
`GET /v1/plans` lists the plan files served; `GET /v1/plans/NAME` is one as JSON (every
node's layouts, the collectives, the estimates); `GET /v1/plans/NAME/explain?node=NODE` says
why that node got its layout (a pipeline plan without `node`: why this stage split).
"""


def openapi() -> dict[str, Any]:
    """The OpenAPI 3.1 document of this API."""
    err = {"$ref": "#/components/responses/Error"}
    errors = {str(s): err for s in (400, 401, 403, 404, 405, 408, 413, 500)}
    ok_json = {"description": "OK", "content": {"application/json": {"schema": {
        "type": "object"}}}}
    query_body = {"type": "object", "required": ["sql"], "additionalProperties": False,
                  "properties": {
                      "sql": {"type": "string", "description": "one read-only statement"},
                      "max_rows": {"type": "integer", "minimum": 1, "maximum": MAX_ROWS,
                                   "default": DEFAULT_ROWS},
                      "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 600,
                                    "default": DEFAULT_TIMEOUT_S},
                      "live_timeout_s": {"type": "number", "exclusiveMinimum": 0,
                                         "maximum": MAX_ASK_S, "default": DEFAULT_ASK_S,
                                         "description": "how long the ranks of live runs "
                                                        "have to give the live_ tables' rows"}}}
    query_out = {"type": "object", "properties": {
        "columns": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "type": {"type": "string"}}}},
        "rows": {"type": "array", "items": {"type": "array"}},
        "row_count": {"type": "integer"}, "truncated": {"type": "boolean"},
        "live": {"type": "object", "description": "with live_ tables: the runs and ranks "
                                                  "that answered"}}}

    def get(summary: str, **extra: Any) -> dict[str, Any]:
        return {"get": {"summary": summary, "responses": {"200": ok_json, **errors}, **extra}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "meshplan serve", "version": "1",
                 "description": "Read-only access to meshplan's telemetry store, runs and "
                                "plans. Every request needs a bearer token."},
        "security": [{"bearer": []}],
        "paths": {
            "/SKILL.md": {"get": {"summary": "How to use this data (for agents)", "responses": {
                "200": {"description": "markdown", "content": {"text/markdown": {}}},
                **errors}}},
            "/v1/openapi.json": get("This document"),
            "/v1/schema": get("Tables, columns, types and views"),
            "/v1/runs": get("Recorded runs with steps, failures, recoveries and whether "
                            "each runs now (live)"),
            "/v1/runs/{run_id}/stacks": get("A running run's Python stacks, every rank's, now",
                                            parameters=[
                {"name": "run_id", "in": "path", "required": True,
                 "schema": {"type": "string"}},
                {"name": "timeout_s", "in": "query", "required": False,
                 "schema": {"type": "number", "default": DEFAULT_ASK_S}}]),
            "/v1/query": {"post": {
                "summary": "One read-only SQL statement over the store and the live "
                           "workers (live_<table>)",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": query_body}}},
                "responses": {"200": {"description": "rows", "content": {"application/json": {
                    "schema": query_out}}}, **errors}}},
            "/v1/plans": get("The plan files served (--plans DIR)"),
            "/v1/plans/{name}": get("One plan as plan show --json prints it", parameters=[
                {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]),
            "/v1/plans/{name}/explain": get("Why a node got its layout (plan explain --json)",
                                            parameters=[
                {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}},
                {"name": "node", "in": "query", "required": False,
                 "schema": {"type": "string"}}]),
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "responses": {"Error": {"description": "a typed error", "content": {
                "application/json": {"schema": {"type": "object", "properties": {"error": {
                    "type": "object", "required": ["type", "message"], "properties": {
                        "type": {"type": "string", "enum": [
                            "unauthorized", "bad_request", "bad_sql", "refused", "not_found",
                            "method_not_allowed", "timeout", "too_large", "internal"]},
                        "message": {"type": "string"}}}}}}}}}},
    }


class _Handler(BaseHTTPRequestHandler):
    service: Service
    server_version = "meshplan-serve/1"

    def _answer(self, method: str) -> None:
        size = int(self.headers.get("Content-Length") or 0)
        if size > MAX_BODY:
            status, ctype, body = _json(ApiError(413, "too_large", f"the body is {size} bytes; "
                                                 f"at most {MAX_BODY}").body(), 413)
        else:
            data = self.rfile.read(size) if size else b""
            status, ctype, body = self.service.handle(method, self.path, self.headers, data)
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="meshplan"')
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:          # noqa: N802 (http.server's names)
        self._answer("GET")

    def do_POST(self) -> None:         # noqa: N802
        self._answer("POST")

    def do_PUT(self) -> None:          # noqa: N802
        self._answer("PUT")

    def do_DELETE(self) -> None:       # noqa: N802
        self._answer("DELETE")

    def log_message(self, format: str, *args: Any) -> None:      # noqa: A002
        pass                           # no request log on stderr (the token is not in it)


def plans_folder(plans: str | os.PathLike | None) -> Path | None:
    """``--plans DIR`` resolved, or None; a TelemetryError where it is no folder."""
    if plans is None:
        return None
    folder = Path(plans).resolve()
    if not folder.is_dir():
        raise TelemetryError(f"--plans {plans}: not a folder; give the folder that holds the "
                             "plan files to serve")
    return folder


def make_server(store: Any, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                token: str | None = None, plans: str | os.PathLike | None = None
                ) -> tuple[ThreadingHTTPServer, Service]:
    """The HTTP server over ``store`` (not started: ``serve_forever()``), and its service.
    ``token`` None: ``$MESHPLAN_TOKEN``, else a new one (``service.token``)."""
    token = token or os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
    service = Service(store, token, plans_folder(plans))
    handler = type("Handler", (_Handler,), {"service": service})
    try:
        server = ThreadingHTTPServer((host, port), handler)
    except OSError as e:
        raise TelemetryError(f"meshplan serve: cannot listen on {host}:{port} ({e.strerror}); "
                             "pick another --port") from None
    server.daemon_threads = True
    return server, service


__all__ = ["ApiError", "DEFAULT_PORT", "Service", "TOKEN_ENV", "make_server", "openapi",
           "plans_folder", "schema", "skill"]
