"""Looking at a running mesh (README, "Live debugging"): every rank's output on the
controller, rank-prefixed and collapsed (``runtime/_logs.py``); every rank's Python stacks on
request and on a hang, stored in telemetry; ``inspect`` of a sharded tensor equal to the
gathered value, and of a watched node's value equal to what one process computes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import meshplan
from meshplan.telemetry import Store
from meshplan.telemetry._schema import segments_dir

_HERE = Path(__file__).parent


@pytest.fixture
def plugins(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(_HERE), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MESHPLAN_WORKER_PLUGINS", "_say,_faults")
    monkeypatch.setenv("MESHPLAN_TEST_FAULTS", "[]")
    return tmp_path


def _mlp_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return model, train


@pytest.mark.timeout(120)
def test_the_output_of_four_ranks_is_prefixed_and_collapsed(plugins, capfd):
    _, train = _mlp_step()
    step = meshplan.distribute(train, mesh={"dp": 4}, telemetry=False)
    x = torch.randn(8, 8)
    with step:
        step(x)
        capfd.readouterr()
        # every rank's copy of a line is waited for up to the window (0.5 s by default): a
        # loaded CI machine may run a rank's side thread much later than the others'
        step._workers.logs.window_s = 60.0
        step._workers.broadcast("say")
        # nothing reads the channel here (a program busy between its calls): the channel's
        # pump takes the lines in once it is left alone, and the reply waits for the gather
        logs = step._workers.logs
        deadline = time.monotonic() + 60
        while logs.printed < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert logs.printed == 8, "the lines waited for the controller to read"
        step._workers.gather("say", 30)
        logs.flush()
        out, err = capfd.readouterr()
    lines = out.splitlines()
    assert lines.count("[train r0-3] the same line on every rank") == 2, out
    assert "[train r1,3] a line of the odd ranks" in lines, out
    for r in range(4):
        assert lines.count(f"[train r{r}] a line of rank {r} alone") == 1, out
    assert "[train r0-3] a warning on every rank" in err.splitlines(), err
    assert not [ln for ln in lines if "a line" in ln and not ln.startswith("[train r")]


@pytest.mark.timeout(120)
def test_stacks_on_request_and_on_a_hang_are_stored_and_top_shows_the_run(plugins, capsys):
    marker = plugins / "fired"
    os.environ["MESHPLAN_TEST_FAULTS"] = json.dumps(
        [{"rank": 1, "step": 4, "at": "forward", "how": "hang", "marker": str(marker)}])
    _, train = _mlp_step()
    db = plugins / "t.duckdb"
    step = meshplan.distribute(train, mesh={"dp": 4}, telemetry=str(db), hang_s=2.0)
    x = torch.randn(8, 8)
    with step:
        step(x)
        for _ in range(5):     # a rank that replied may not yet be in its poll, under load
            got = step.stacks()
            assert sorted(got) == [0, 1, 2, 3]
            assert {s["doing"] for s in got.values()} == {"waiting for the controller"}
            if "--- r0-3: waiting for the controller" in str(got):
                break
            time.sleep(0.1)
        assert "--- r0-3: waiting for the controller" in str(got)
        run = step.run_id
        with _serving(db) as api:
            live = api.live_during(lambda: [step(x) for _ in range(5)], run)
        # a hang at step 4 (after 3 timed steps: the deadline is then hang_s): found, the
        # mesh brought back
        assert step.restarts == 1
        live_file = segments_dir(db) / run / "live.json"
        assert live_file.stat().st_mode & 0o777 == 0o600
    assert not live_file.exists()
    # meshplan serve, while the steps ran: the live_ tables held every rank's rows of the
    # steps done so far (rank 1 stopped at 3 while it hung), and its stacks showed the hang
    first = live["rows"][0]
    assert first["live"]["runs"][0]["answered"] == [0, 1, 2, 3], first
    assert {(r[0], r[1]) for r in first["rows"]} == {(rank, run) for rank in range(4)}
    assert any(st["stacks"].get("1", {}).get("doing") == "'step' of step 4" and
               "_fire" in st["stacks"]["1"]["frame"] for st in live["stacks"]), live["stacks"]
    assert max(r[2] for q in live["rows"] for r in q["rows"] if r[0] == 1) >= 3
    assert live["runs_live"] and not live["wrong_token"].ok
    with Store.open(db) as store:
        rows = store.sql("SELECT rank, reason, doing, frame, stack FROM stacks WHERE run_id = ? "
                         "ORDER BY reason, rank", [run]).to_pylist()
    request = [r for r in rows if r["reason"] == "request"]
    hang = [r for r in rows if r["reason"] == "timeout"]
    assert sorted({r["rank"] for r in request}) == [0, 1, 2, 3] and len(request) % 4 == 0
    assert [r["rank"] for r in hang] == [0, 1, 2, 3]
    stuck = hang[1]
    assert re.search(r"_faults\.py:\d+ in _fire", stuck["frame"]), stuck["frame"]
    assert stuck["doing"] == "'step' of step 4"
    assert "Thread MainThread (main)" in stuck["stack"]
    # meshplan top: the run at a glance, from the same store
    from meshplan.cli import main

    assert main(["top", "--db", str(db), "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["run_id"] == run and view["latest_step"] == 5 and view["recoveries"] == 1
    assert [r["rank"] for r in view["ranks"]] == [0, 1, 2, 3]
    assert all(r["behind"] == 0 and r["peak_bytes"] > 0 for r in view["ranks"])
    assert {s["reason"] for s in view["stacks"]} == {"timeout"}
    assert view["collectives"][0]["kind"] == "all_reduce"
    assert main(["top", "--db", str(db), "--once"]) == 0
    out = capsys.readouterr().out
    assert f"run {run}" in out and "latest step 5" in out and "timeout" in out


class _Api:
    """``meshplan serve``'s HTTP API over ``db`` in this process (a real HTTP client)."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token

    def get(self, path: str, token: str | None = None):
        import requests

        return requests.get(self.url + path, timeout=30,
                            headers={"Authorization": f"Bearer {token or self.token}"})

    def sql(self, sql: str) -> dict:
        import requests

        r = requests.post(self.url + "/v1/query", json={"sql": sql}, timeout=30,
                          headers={"Authorization": f"Bearer {self.token}"})
        assert r.status_code == 200, r.text
        return r.json()

    def live_during(self, work, run: str) -> dict:
        """What an agent sees while ``work()`` runs the steps: the live_ rows and the
        stacks, asked again and again from another thread."""
        import threading

        seen: dict = {"rows": [], "stacks": []}
        done = threading.Event()

        def ask() -> None:
            seen["runs_live"] = any(r["live"] for r in self.get("/v1/runs").json()["runs"]
                                    if r["run_id"] == run)
            while not done.is_set():
                seen["rows"].append(self.sql(
                    "SELECT rank, run_id, max(step) FROM live_steps GROUP BY ALL ORDER BY 1"))
                got = self.get(f"/v1/runs/{run}/stacks?timeout_s=1")
                if got.status_code == 200:
                    seen["stacks"].append(got.json())
                time.sleep(0.2)
        seen["wrong_token"] = self.get("/v1/runs", token="wrong")
        thread = threading.Thread(target=ask)
        thread.start()
        try:
            work()
        finally:
            done.set()
            thread.join(60)
        return seen


@contextlib.contextmanager
def _serving(db: Path):
    import threading

    from meshplan._serve import make_server

    store = Store.open(db)          # closed before the step's end ingests into the database
    server, service = make_server(store, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield _Api(f"http://127.0.0.1:{server.server_address[1]}", service.token)
    finally:
        server.shutdown()
        server.server_close()
        store.close()


@pytest.mark.timeout(120)
def test_inspect_a_sharded_tensor_and_a_watched_value():
    model, train = _mlp_step()
    x = torch.randn(8, 8)
    step = meshplan.distribute(train, mesh={"dp": 2}, strategy="fsdp", telemetry=False)
    with step:
        step(x)
        whole = step.state_dict()["model"]
        pieces = [step.inspect("0.weight", rank=r) for r in range(2)]
        assert [tuple(p.shape) for p in pieces] == [(8, 8), (8, 8)]        # FSDP's rows
        assert torch.equal(torch.cat(pieces), whole["0.weight"])
        assert torch.equal(step.inspect("0.weight"), whole["0.weight"])
        node = next(n.name for n in step.plan.graph.nodes if n.target.startswith("aten.addmm"))
        with pytest.raises(meshplan.RuntimeFailure, match="is not watched"):
            step.inspect(node)
        step.watch(node)
        step(x)
        want = x @ whole["0.weight"].T + whole["0.bias"]      # the first layer, before step 2
        torch.testing.assert_close(step.inspect(node), want, rtol=1e-5, atol=1e-6)
        with pytest.raises(meshplan.RuntimeFailure, match="neither a state tensor"):
            step.inspect("0.wieght")
