"""``meshplan mcp``: the tools of ``meshplan serve`` as an MCP server on stdio (issue 25,
point 3), for agents that speak the Model Context Protocol.

    meshplan mcp [--db PATH] [--plans DIR]

The client starts it as a subprocess and talks JSON-RPC over its stdin/stdout, so no token is
needed: only that client reaches it. Its instructions are ``/SKILL.md``. Tools (the same
answers as the HTTP API, ``_serve.py``, whose ``Service`` does the work):

- ``schema()``: the tables, their columns and types, the views;
- ``query(sql, max_rows=1000, timeout_s=30)``: one read-only statement (writes and file
  access refused, rows capped, interrupted at the timeout);
- ``query``'s ``live_<table>``: what the running ranks hold now (``_serve.py``);
- ``runs()``: the runs with their steps, failures and recoveries, and which run now;
- ``stacks(run_id, timeout_s=3)``: a running run's Python stacks, every rank's;
- ``plans()``, ``plan_show(name)``, ``plan_explain(name, node=None)``: the plan files of
  ``--plans DIR``.

A refused or bad request comes back as the tool's error (``is_error``), its text
``"<type>: <message>"`` with the HTTP API's error types (``bad_sql``, ``refused``, ``timeout``,
``not_found``, ``bad_request``). Needs the ``mcp`` package: ``pip install 'meshplan[agents]'``.
"""

from __future__ import annotations

import json
from typing import Any

from ._errors import TelemetryError
from ._serve import (DEFAULT_ROWS, DEFAULT_TIMEOUT_S, ApiError, Service, _query_args,
                     _seconds, plans_folder, schema, skill)
from .runtime._live import DEFAULT_ASK_S


def build(service: Service) -> Any:
    """The MCP server (``mcp.server.mcpserver.MCPServer``) answering with ``service``."""
    try:
        from mcp.server.mcpserver import MCPServer
        from mcp.server.mcpserver.exceptions import ToolError
    except ImportError as e:
        raise TelemetryError(f"meshplan mcp needs the mcp package ({e}): pip install "
                             "'meshplan[agents]'") from None
    import importlib.metadata

    server = MCPServer("meshplan", instructions=skill(),
                       version=importlib.metadata.version("meshplan"))

    def answer(fn: Any, *args: Any) -> dict[str, Any]:
        try:
            return fn(*args)
        except ApiError as e:
            raise ToolError(f"{e.kind}: {e.message}") from None

    @server.tool(name="schema", description="The telemetry tables, their columns and types, "
                                             "and the views. Read it before writing SQL.")
    def schema_tool() -> dict[str, Any]:
        return schema()

    @server.tool(description="One read-only SQL statement (SELECT, WITH, DESCRIBE, SHOW, "
                             "SUMMARIZE, EXPLAIN) over the telemetry store: its columns, at "
                             "most max_rows rows, and whether more were left out. live_<table> "
                             "(live_steps, ...) reads what the running ranks hold now.")
    def query(sql: str, max_rows: int = DEFAULT_ROWS, timeout_s: float = DEFAULT_TIMEOUT_S,
              live_timeout_s: float = DEFAULT_ASK_S) -> dict[str, Any]:
        args = answer(_query_args, json.dumps({"sql": sql, "max_rows": max_rows,
                                               "timeout_s": timeout_s,
                                               "live_timeout_s": live_timeout_s}).encode())
        return answer(lambda: service.query(**args))

    @server.tool(description="Every recorded run: its mesh, strategy, steps, failures and "
                             "recoveries, whether its last failure was recovered from, and "
                             "whether it runs now (live).")
    def runs() -> dict[str, Any]:
        return answer(service.runs)

    @server.tool(description="A running run's Python stacks, every rank's, now (for a run "
                             "that seems stuck; 'doing' says what each rank was asked to do).")
    def stacks(run_id: str, timeout_s: float = DEFAULT_ASK_S) -> dict[str, Any]:
        return answer(lambda: service.stacks(
            run_id, _seconds({"timeout_s": str(timeout_s)}, "timeout_s")))

    @server.tool(description="The plan files served (meshplan mcp --plans DIR).")
    def plans() -> dict[str, Any]:
        return answer(lambda: {"plans": [p.name for p in service._plan_files()]})

    @server.tool(description="One plan as `meshplan plan show --json` prints it: every node's "
                             "layouts, the collectives, the estimates.")
    def plan_show(name: str) -> dict[str, Any]:
        return answer(service.plan_show, name)

    @server.tool(description="Why a node of a plan got its layout (`meshplan plan explain "
                             "--json`); a pipeline plan without a node: why this stage split.")
    def plan_explain(name: str, node: str | None = None) -> dict[str, Any]:
        return answer(service.plan_explain, name, node)

    return server


def run_stdio(store: Any, plans: str | None) -> None:
    """Serve ``store`` (and the plan files of ``plans``) over stdio until the client leaves."""
    build(Service(store, token="", plans=plans_folder(plans))).run("stdio")


__all__ = ["build", "run_stdio"]
