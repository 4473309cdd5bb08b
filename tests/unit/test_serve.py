"""``meshplan serve`` (``_serve.py``) through a real HTTP client (requests): the
token, read-only SQL over the store with its refusals, row limit and timeout, the runs, the
plans, the OpenAPI document (checked by openapi-spec-validator) and typed errors; and
``meshplan mcp`` (``_mcp.py``) through the MCP client library on stdio.

The store holds ``test_telemetry_store``'s hand-made runs: ``r1`` (6 steps on 4 ranks, no
failure) and ``r2`` (3 steps, a failure), so the counts below are exact.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests
import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_telemetry_store import T0, make_run  # noqa: E402

import meshplan  # noqa: E402
from meshplan._cli_plan import explain_data, show_data  # noqa: E402
from meshplan.planner import plan_graph  # noqa: E402
from meshplan.telemetry._schema import segments_dir  # noqa: E402
from meshplan._serve import make_server  # noqa: E402
from meshplan.telemetry._store import Store  # noqa: E402

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    db = tmp / "t.duckdb"
    make_run(segments_dir(db), "r1", start=T0, steps=6, straggler=True)
    make_run(segments_dir(db), "r2", start=T0 + 10**9, steps=3, straggler=False, failure=True)
    plans = tmp / "plans"
    plans.mkdir()
    lin = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)

    def step(x):
        loss = lin(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    plan_graph(meshplan.trace(step, torch.randn(4, 8)).graph, {"dp": 2}).save(plans / "mlp.plan")
    (plans / "notes.txt").write_text("not a plan")
    store = Store.open(db)
    server, _ = make_server(store, port=0, token=TOKEN, plans=plans)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    yield url, plans, db
    server.shutdown()
    server.server_close()
    store.close()


def _get(url: str, path: str, token: str | None = TOKEN, **kw) -> requests.Response:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return requests.get(url + path, headers=headers, timeout=30, **kw)


def _sql(url: str, sql: str, **kw) -> requests.Response:
    return requests.post(url + "/v1/query", json={"sql": sql, **kw}, timeout=30,
                         headers={"Authorization": f"Bearer {TOKEN}"})


def _error(r: requests.Response, status: int, kind: str, words: str = "") -> None:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == kind and words in err["message"], err


def test_every_request_needs_the_token(api) -> None:
    url, _, _ = api
    for token in (None, "wrong", TOKEN + "x"):
        r = _get(url, "/SKILL.md", token)
        _error(r, 401, "unauthorized", "Authorization: Bearer")
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
    _error(requests.post(url + "/v1/query", json={"sql": "SELECT 1"}, timeout=30), 401,
           "unauthorized")
    skill = _get(url, "/SKILL.md")
    assert skill.status_code == 200 and skill.headers["Content-Type"].startswith("text/markdown")
    assert "GET /v1/schema" in skill.text and "`steps`: run_id, rank, step" in skill.text


def test_read_only_sql_with_limits_and_typed_errors(api) -> None:
    url, _, db = api
    r = _sql(url, "SELECT rank, count(*) AS n FROM steps WHERE run_id = 'r1' GROUP BY rank "
                  "ORDER BY rank")
    assert r.status_code == 200
    got = r.json()
    assert [c["name"] for c in got["columns"]] == ["rank", "n"]
    assert got["rows"] == [[k, 6] for k in range(4)] and not got["truncated"]
    got = _sql(url, "SELECT * FROM steps", max_rows=5).json()
    assert got["row_count"] == 5 and got["truncated"]
    assert _sql(url, "DESCRIBE steps").status_code == 200
    for sql, what in (("DELETE FROM steps", "DELETE is not allowed"),
                      ("CREATE TABLE x AS SELECT 1", "CREATE is not allowed"),
                      ("COPY steps TO '/tmp/meshplan-serve-leak.csv'", "COPY is not allowed"),
                      ("ATTACH '/tmp/meshplan-other.db'", "ATTACH is not allowed"),
                      ("SET threads = 1", "SET is not allowed"),
                      ("SELECT * FROM read_csv('/etc/hostname')", "Cannot access file")):
        _error(_sql(url, sql), 403, "refused", what)
    assert not Path("/tmp/meshplan-serve-leak.csv").exists()
    _error(_sql(url, "SELEC 1"), 400, "bad_sql", "syntax error")
    _error(_sql(url, "SELECT nope FROM steps"), 400, "bad_sql", "GET /v1/schema")
    _error(_sql(url, "SELECT 1; SELECT 2"), 400, "bad_sql", "one statement")
    _error(_sql(url, "SELECT count(*) FROM range(1000000000000)", timeout_s=0.5), 408,
           "timeout", "timeout_s=0.5")
    _error(_sql(url, "SELECT 1", max_rows=0), 400, "bad_request", "max_rows=0")
    _error(_sql(url, "SELECT 1", limit=3), 400, "bad_request", "unknown fields ['limit']")
    headers = {"Authorization": f"Bearer {TOKEN}"}
    _error(requests.post(url + "/v1/query", data=b"{", headers=headers, timeout=30), 400,
           "bad_request", "not JSON")
    _error(requests.post(url + "/v1/query", data=b"x" * (2 << 20), headers=headers, timeout=30),
           413, "too_large")
    _error(requests.delete(url + "/v1/runs", headers=headers, timeout=30), 405,
           "method_not_allowed", "use GET")
    _error(_get(url, "/v1/nothing"), 404, "not_found", "openapi.json")
    assert _sql(url, "SELECT count(*) FROM steps").json()["rows"] == [[24 + 12]]   # unchanged
    # live_<table>: no run is live (r1's live.json is a controller's that ended)
    stale = segments_dir(db) / "r1" / "live.json"
    stale.write_text('{"run_id": "r1", "url": "http://127.0.0.1:9", "token": "t"}')
    try:
        got = _sql(url, "SELECT count(*) AS n FROM live_steps JOIN runs USING (run_id)").json()
        assert got["rows"] == [[0]] and got["live"] == {"runs": [], "unreachable": []}
        assert "live" not in _sql(url, "SELECT 1").json()
        _error(_sql(url, "SELECT 1", live_timeout_s=0), 400, "bad_request", "live_timeout_s=0")
    finally:
        stale.unlink()


def test_runs_plans_and_the_openapi_document(api) -> None:
    from openapi_spec_validator import validate

    url, plans, _ = api
    runs = {r["run_id"]: r for r in _get(url, "/v1/runs").json()["runs"]}
    assert runs["r1"]["steps"] == 6 and runs["r1"]["failures"] == 0 and runs["r1"]["recovered"]
    assert not runs["r1"]["live"]
    assert runs["r2"]["steps"] == 3 and runs["r2"]["failures"] == 1
    assert not runs["r2"]["recovered"] and runs["r2"]["world_size"] == 4
    assert _get(url, "/v1/plans").json() == {"plans": ["mlp.plan"]}
    assert _get(url, "/v1/plans/mlp.plan").json() == show_data(str(plans / "mlp.plan"))
    node = next(n for n in show_data(str(plans / "mlp.plan"))["nodes"] if n["target"] ==
                "aten.addmm.default")["name"]
    assert _get(url, f"/v1/plans/mlp.plan/explain?node={node}").json() == \
        explain_data(str(plans / "mlp.plan"), node)
    _error(_get(url, "/v1/plans/mlp.plan/explain"), 400, "bad_request", "--node NAME")
    for name in ("notes.txt", "..%2Ft.duckdb", "nosuch.plan"):
        _error(_get(url, f"/v1/plans/{name}"), 404, "not_found")
    doc = _get(url, "/v1/openapi.json").json()
    validate(doc)
    for path, ops in doc["paths"].items():
        if "get" in ops:
            got = _get(url, path.replace("{name}", "mlp.plan").replace("{run_id}", "r1"))
            if path.endswith("/stacks"):      # r1 does not run now
                _error(got, 404, "not_found", "is not running")
                continue
            assert got.status_code in (200, 400), (path, got.text)
        assert path == "/v1/query" or "post" not in ops
    assert _get(url, "/v1/schema").json()["tables"]["runs"][0] == {"name": "run_id",
                                                                  "type": "string"}


def test_the_cli_prints_where_and_the_token(tmp_path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "meshplan", "serve", "--port", "0", "--db",
                             str(tmp_path / "t.duckdb")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        first, second = proc.stdout.readline(), proc.stdout.readline()
        assert first.startswith("meshplan serve: http://127.0.0.1:"), (first, proc.stderr)
        url = first.split()[2]
        token = second.split("token: ")[1].strip()
        assert _get(url, "/v1/runs", token).json() == {"runs": []}
        _error(_get(url, "/v1/runs", "x"), 401, "unauthorized")
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_mcp_server_answers_a_real_mcp_client(api) -> None:
    """``meshplan mcp`` started by the MCP SDK's stdio client: its tools, their answers
    (the store is held by this process's server, so it reads the segments), and typed
    errors as the tools' errors."""
    import json

    import anyio
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    url, plans, db = api

    async def talk() -> dict:
        params = StdioServerParameters(command=sys.executable, args=[
            "-m", "meshplan", "mcp", "--db", str(db), "--plans", str(plans)])
        out: dict = {}
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                init = await session.initialize()
                out["instructions"] = init.instructions
                out["tools"] = sorted(t.name for t in (await session.list_tools()).tools)
                for key, name, args in (
                        ("count", "query", {"sql": "SELECT count(*) AS n FROM steps"}),
                        ("few", "query", {"sql": "SELECT * FROM steps", "max_rows": 2}),
                        ("delete", "query", {"sql": "DELETE FROM steps"}),
                        ("typo", "query", {"sql": "SELEC 1"}),
                        ("runs", "runs", {}), ("plans", "plans", {}),
                        ("show", "plan_show", {"name": "mlp.plan"}),
                        ("missing", "plan_show", {"name": "nosuch.plan"}),
                        ("schema", "schema", {})):
                    res = await session.call_tool(name, args)
                    text = res.content[0].text
                    out[key] = (res.is_error, text if res.is_error else json.loads(text))
        return out

    got = anyio.run(talk)
    assert "GET /v1/schema" in got["instructions"]
    assert got["tools"] == ["plan_explain", "plan_show", "plans", "query", "runs", "schema",
                            "stacks"]
    assert got["count"] == (False, {"columns": [{"name": "n", "type": "int64"}],
                                    "rows": [[36]], "row_count": 1, "truncated": False})
    assert got["few"][1]["row_count"] == 2 and got["few"][1]["truncated"]
    for key, words in (("delete", "refused: DELETE is not allowed"),
                       ("typo", "bad_sql: Parser Error"), ("missing", "not_found: no plan")):
        assert got[key][0] and words in got[key][1], (key, got[key])
    assert {r["run_id"] for r in got["runs"][1]["runs"]} == {"r1", "r2"}
    assert got["plans"] == (False, {"plans": ["mlp.plan"]})
    assert got["show"] == (False, show_data(str(plans / "mlp.plan")))
    assert "steps" in got["schema"][1]["tables"]
