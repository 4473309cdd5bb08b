"""``meshplan plan show|explain|diff`` run as a user runs them: ``python -m meshplan ...`` in a
fresh process from the repository root (one run per command and one bad input; the other
checks through ``cli.main`` in this process), on small MLP plans (dp=2 with "dp", dp=2,tp=2 with
"megatron_tp", topology h100) made once per module.

Pins down: the text summary names the mesh, the step time and a collective; ``--json`` follows
the documented report schema and its numbers equal the Plan's; ``explain`` reports the plan's
own choice among >= 2 priced alternatives; ``diff`` shows what changed (and nothing for a plan
against itself); ``--html`` is one offline page showing the numbers; bad input exits 1 with one
stderr line and no traceback; the dp=2 report matches its golden snapshot
(``MESHPLAN_UPDATE_GOLDEN=1`` rewrites it).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import meshplan
import pytest
import torch
from meshplan.examples import mlp
from meshplan.planner import Plan, plan_graph

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"
TIMEOUT = 120


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="200")
    proc = subprocess.run([sys.executable, "-m", "meshplan", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT, check=False)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


# the commands that run in a fresh process: one per command (show, explain, diff) and one bad
# input; the others go through ``cli.main`` in this process meanwhile (the same ``main``; each
# fresh process costs a torch import)
IN_A_PROCESS = {"show", "explain_json", "diff_json", "bad:content hash"}


def _in_process(*args: str) -> Future[subprocess.CompletedProcess[str]]:
    """``_main(ARGS)`` as a finished future of what ``_run`` returns."""
    rc, out, err = _main(*args)
    done: Future[subprocess.CompletedProcess[str]] = Future()
    done.set_result(subprocess.CompletedProcess(list(args), rc, out, err))
    return done


@pytest.fixture(scope="module")
def cli(plans: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:
    """Every command of this module started at once (``IN_A_PROCESS``: each a fresh interpreter
    and a torch import; the rest in this process meanwhile); a test waits only for its own."""
    (a, _), (b, _) = plans["dp"], plans["tp"]
    html = tmp_path_factory.mktemp("html") / "plan.html"
    cmds: dict[str, tuple[str, ...]] = {
        "show": ("plan", "show", str(b)),
        "show_json": ("plan", "show", str(b), "--json"),
        "explain_json": ("plan", "explain", str(b), "--node", "addmm", "--json"),
        "diff_json": ("plan", "diff", str(a), str(b), "--json"),
        "html": ("plan", "show", str(b), "--html", str(html)),
    }
    bad = _bad_files(plans, tmp_path_factory.mktemp("bad"))
    cmds.update({f"bad:{pattern}": tuple(args) for pattern, args in bad.items()})
    with ThreadPoolExecutor(8) as pool:
        futures = {k: pool.submit(_run, *args, check=False) for k, args in cmds.items()
                   if k in IN_A_PROCESS}
        futures.update({k: _in_process(*args) for k, args in cmds.items()
                        if k not in IN_A_PROCESS})
        futures["html_path"] = pool.submit(lambda: html)
        yield futures


def _main(*args: str) -> tuple[int, str, str]:
    """In-process ``meshplan`` for the cheaper checks: the same ``main`` the subprocesses run."""
    import contextlib
    import io

    from meshplan.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


def _ok(cli: dict[str, Future], key: str) -> subprocess.CompletedProcess[str]:
    proc = cli[key].result()
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Plan]]:
    ex = mlp.build(optimizer="adamw")
    graph = meshplan.trace(ex.step, *ex.batch(0)).graph
    folder = tmp_path_factory.mktemp("plans")
    out = {}
    for key, axes, strategy in (("dp", {"dp": 2}, "dp"),
                                ("tp", {"dp": 2, "tp": 2}, "megatron_tp")):
        plan = plan_graph(graph, axes, topology="h100", strategy=strategy)
        path = folder / f"mlp_{key}.plan"
        plan.save(path)
        out[key] = (path, plan)
    return out


def test_show_text_names_mesh_time_and_collectives(plans: dict, cli: dict) -> None:
    _, plan = plans["tp"]
    out = _ok(cli, "show").stdout
    assert "dp=2,tp=2" in out and "megatron_tp" in out
    assert f"{plan.estimated_step_time_s * 1e3:.4f} ms" in out
    kind, axis, _ = next(c for r in plan.redistributions for c in r.collectives)
    assert kind in out and axis in out
    assert "memory per rank" in out and "solver" in out and "fallbacks" in out
    # an h100 plan lowers for cuda: the AdamW update of every parameter is the Triton kernel
    assert "kernels the lowering substitutes (rank 0, cuda)" in out and "adamw" in out


def test_show_json_schema_and_numbers(plans: dict, cli: dict) -> None:
    _, plan = plans["tp"]
    rep = json.loads(_ok(cli, "show_json").stdout)
    assert rep["format"] == "meshplan.plan-report" and rep["version"] == 1
    for key in ("mesh", "topology", "strategy", "estimated_step_time_s", "compute_time_s",
                "comm_time_s", "peak_memory_bytes", "memory_limit_bytes", "fits", "memory",
                "nodes", "layers", "collectives", "fallbacks", "solver"):
        assert key in rep, key
    assert rep["mesh"]["axes"] == [["dp", 2], ["tp", 2]] and rep["mesh"]["topology"] == "h100"
    assert rep["estimated_step_time_s"] == plan.estimated_step_time_s
    assert rep["comm_time_s"] == plan.comm_time_s
    assert rep["peak_memory_bytes"] == plan.peak_memory_bytes
    assert len(rep["nodes"]) == len(plan.placements)
    assert len(rep["collectives"]) == len(plan.redistributions)
    m = rep["memory"]
    assert m["parameters_bytes"] > 0 and m["optimizer_state_bytes"] > 0
    assert sum(m[k] for k in ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes",
                              "buffers_bytes", "activations_bytes")) == plan.peak_memory_bytes
    fc1 = next(l for l in rep["layers"] if l["layer"] == "model.fc1")
    assert fc1["params"]["weight"] == ["(R, S(0))"]
    k = rep["kernels"]
    params = sum(n.meta.role.value == "param" for n in plan.graph.inputs)
    assert k["device"] == "cuda" and k["rank"] == 0
    (adamw,) = [r for r in k["kernels"] if r["kernel"] == "adamw"]
    assert adamw["backend"] == "triton" and adamw["updates"] == params
    assert adamw["replaced_nodes"] >= 7 * params


def test_show_says_when_random_ops_do_not_match_one_process(plans: dict,
                                                           tmp_path: Path) -> None:
    """A step with dropout: ``plan show`` lists its random ops in --json (with the layouts
    that decide which ranks draw alike) and says in one line that they do not match one
    process bit for bit, as ``Plan.summary()`` does; a step without says nothing of it."""
    ex = mlp.build(optimizer="adamw")
    ex.model.act = torch.nn.Sequential(ex.model.act, torch.nn.Dropout(0.2))
    graph = meshplan.trace(ex.step, *ex.batch(0)).graph
    plan = plan_graph(graph, {"dp": 2}, topology="cpu", strategy="dp")
    path = tmp_path / "dropout.plan"
    plan.save(path)
    rc, out, err = _main("plan", "show", str(path))
    assert rc == 0, err
    line = "1 random op (aten.bernoulli.p x1); they do not match one process bit for bit"
    assert line in " ".join(out.split()) and line in " ".join(plan.summary().split())
    rc, out, err = _main("plan", "show", str(path), "--json")
    (op,) = json.loads(out)["random_ops"]
    # the data-parallel plan splits the mask with the batch: each rank draws its rows
    assert op["target"] == "aten.bernoulli.p" and op["outputs"] == ["(S(0))"]
    assert "mlp.py:" in op["source"]
    rc, out, err = _main("plan", "show", str(plans["dp"][0]))
    assert rc == 0 and "random op" not in out


def test_explain_reports_the_chosen_layout_and_priced_alternatives(plans: dict, cli: dict) -> None:
    _, plan = plans["tp"]
    ex = json.loads(_ok(cli, "explain_json").stdout)
    mine = plan.placement("addmm")
    assert ex["chosen"]["chosen"] is True
    assert ex["chosen"]["outputs"] == [", ".join(map(str, mine.outputs[0])).join("()")]
    assert len(ex["alternatives"]) >= 2
    assert sum(r["chosen"] for r in ex["alternatives"]) == 1
    for r in ex["alternatives"]:
        for key in ("compute_s", "input_reshard_s", "output_reshard_s", "total_s"):
            assert r[key] is None or r[key] >= 0, (key, r)
    assert ex["why"].startswith("chosen")
    text = _main("plan", "explain", str(plans["tp"][0]), "--node", "addmm")[1]
    assert "choices" in text and ex["why"][:30] in text


def test_diff_shows_placements_and_time(plans: dict, cli: dict) -> None:
    (_, pa), (_, pb) = plans["dp"], plans["tp"]
    d = json.loads(_ok(cli, "diff_json").stdout)
    assert d["placements"] and not d["identical"]
    assert d["strategy"] == {"before": "dp", "after": "megatron_tp"}
    assert math.isclose(d["estimated_step_time_s"]["delta"],
                        pb.estimated_step_time_s - pa.estimated_step_time_s)
    a, b = str(plans["dp"][0]), str(plans["tp"][0])
    assert "placements changed" in _main("plan", "diff", a, b)[1]
    same = json.loads(_main("plan", "diff", a, a, "--json")[1])
    assert same["identical"] and not same["placements"]
    assert not same["collectives_only_in_a"] and not same["collectives_only_in_b"]
    assert "identical" in _main("plan", "diff", a, a)[1]


def _html(plans: dict, cli: dict) -> tuple[Path, Plan]:
    _ok(cli, "html")
    return cli["html_path"].result(), plans["tp"][1]


def test_html_is_one_offline_page_with_the_numbers(plans: dict, cli: dict) -> None:
    out, plan = _html(plans, cli)
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "http://" not in page and "https://" not in page and "src=" not in page
    assert f"{plan.estimated_step_time_s * 1e3:.3f} ms" in page
    assert "memory per rank" in page and "<svg" in page


def test_html_renders_in_headless_chromium(plans: dict, cli: dict) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium not installed (Debian package `chromium`)")
    out, plan = _html(plans, cli)
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                           "--enable-logging=stderr", "--v=0", "--dump-dom", out.as_uri()],
                          capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert proc.returncode == 0, proc.stderr
    assert f"{plan.estimated_step_time_s * 1e3:.3f} ms" in proc.stdout
    assert "CONSOLE" not in proc.stderr and "Uncaught" not in proc.stderr, proc.stderr


def _bad_files(plans: dict, tmp_path: Path) -> dict[str, list[str]]:
    path, _ = plans["dp"]
    text = path.read_text()
    truncated = tmp_path / "truncated.plan"
    truncated.write_text(text[: len(text) // 2])
    tampered = tmp_path / "tampered.plan"
    d = json.loads(text)
    d["body"]["strategy"] = "fsdp"
    tampered.write_text(json.dumps(d))
    return {
        "does not exist|no such|not found": ["plan", "show", str(tmp_path / "missing.plan")],
        "not a meshplan plan": ["plan", "show", str(truncated)],
        "content hash": ["plan", "show", str(tampered), "--json"],
        "did you mean addmm": ["plan", "explain", str(path), "--node", "addm"],
    }


def test_bad_input_is_one_line_without_traceback(cli: dict) -> None:
    import re

    for key in [k for k in cli if k.startswith("bad:")]:
        pattern, proc = key[4:], cli[key].result()
        args = proc.args
        assert proc.returncode == 1, (args, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert lines[0].startswith("PlanError: ") and re.search(pattern.strip(), lines[0], re.IGNORECASE), lines


def test_foreign_file_is_one_plan_error(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.plan"
    foreign.write_text(json.dumps({"format": "something.else", "body": {}}))
    rc, _, err = _main("plan", "show", str(foreign))
    assert rc == 1 and err.count("\n") == 1 and err.startswith("PlanError: ")
    assert "not a meshplan plan" in err


def _stable(rep: dict) -> dict:
    """The report without what varies between runs or machines: solver wall times, the
    absolute path of the source files."""
    rep = dict(rep)
    rep["solver"] = {k: v for k, v in rep["solver"].items() if not k.endswith("_s")}
    for key in ("graph_hash", "torch_version", "meshplan_version"):   # machine / install
        rep.pop(key, None)
    rep["nodes"] = [dict(n, source=n["source"] and Path(n["source"]).name) for n in rep["nodes"]]
    return rep


def _rounded(x: object) -> object:
    if isinstance(x, float):
        return float(f"{x:.9g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def test_golden_report_of_the_dp_plan(plans: dict) -> None:
    rc, out, err = _main("plan", "show", str(plans["dp"][0]), "--json")
    assert rc == 0, err
    rep = _stable(json.loads(out))
    golden = GOLDEN / "mlp_dp2_dp.json"
    if os.environ.get("MESHPLAN_UPDATE_GOLDEN") == "1" or not golden.exists():
        if not golden.exists() and os.environ.get("MESHPLAN_UPDATE_GOLDEN") != "1":
            pytest.fail(f"{golden} is missing; run with MESHPLAN_UPDATE_GOLDEN=1 to write it")
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(json.dumps(rep, indent=1, sort_keys=True) + "\n")
    want = json.loads(golden.read_text())
    assert _rounded(rep) == _rounded(want), (
        "the dp=2 plan report changed; if intended, rerun with MESHPLAN_UPDATE_GOLDEN=1 and "
        "review the diff of tests/e2e/golden/mlp_dp2_dp.json")


def test_compile_on_a_pp_mesh_writes_a_pipeline_plan_that_run_runs(tmp_path) -> None:
    """``compile --mesh pp=2,dp=2``: the pipeline plan (stages, schedule drawn), written as
    JSON; ``run`` runs a ZB-H1 one (losses equal one process's: rtol 1e-5, the summation
    order of the micro-batches' gradients, as in ``test_run_matches_the_eager_step``);
    ``plan show`` prints the stages and every stage's layouts (``--html``: the schedule
    drawn), ``plan explain`` why this split, ``plan diff`` what changed between two; a plan
    whose micro-batches differ from the decorator's, and a modified file, are refused;
    ``--schedule`` without a pp axis is refused."""
    from meshplan.examples import gpt

    for name in ("gpt_distributed.py", "gpt.py", "_common.py"):    # outside the package:
        shutil.copy(REPO / "examples" / name, tmp_path / name)      # the in-process CLI
    target = f"{tmp_path / 'gpt_distributed.py'}:train_step"      # loads it as a module
    out, gp = tmp_path / "pp.plan", tmp_path / "1f1b.plan"
    rc, text, err = _main("compile", target, "--mesh", "pp=2,dp=2", "--topology", "h100",
                          "--schedule", "zb-h1", "--microbatches", "2", "-o", str(out))
    assert rc == 0, err
    assert "2 stages, zb-h1" in text and "stage   1 |" in text
    assert json.loads(out.read_text())["format"] == "meshplan.pipeline-plan"
    rc, text, err = _main("plan", "show", str(out))
    assert rc == 0 and "2 stages, zb-h1" in text and "every stage's layouts" in text, err
    rc, text, err = _main("plan", "explain", str(out))      # why this split
    assert rc == 0 and "why this split: 2 stages x 1 chunk per device" in text, err
    assert "chunk  1 on stage  1: 1 layer (model.transformer.h.1) + <post>" in text
    assert "schedules tried (fastest first; * the plan):\n  * zb-h1" in text
    rc, text, err = _main("plan", "explain", str(out), "--node", "addmm", "--json")
    assert rc == 0 and json.loads(text)["stage"].startswith("on stage 0, with unit "
                                                            "model.transformer.h.0"), err
    rc, text, err = _main("plan", "show", str(out), "--html", str(tmp_path / "pp.html"))
    page = (tmp_path / "pp.html").read_text()
    assert rc == 0 and "<svg id=schedule" in page and "every stage's layouts" in page, err
    rc, text, err = _main("compile", target, "--mesh", "pp=2,dp=2", "--topology", "h100",
                          "--schedule", "1f1b", "--microbatches", "2", "-o", str(gp))
    assert rc == 0 and "`meshplan run` runs it" in text, err
    rc, text, err = _main("plan", "diff", str(out), str(gp))
    assert rc == 0 and "schedule: zb-h1 -> 1f1b" in text, err
    rc, text, err = _main("plan", "diff", str(gp), str(gp))
    assert rc == 0 and "pipeline plans are identical" in text, err
    rc, _, err = _main("plan", "diff", str(gp), target.split(":")[0])
    assert rc != 0 and "is a pipeline plan (a 'pp' mesh axis) and" in err
    # a step whose decorator asks for other micro-batches than the plan runs: refused, as
    # distribute(plan=) refuses it
    src = (tmp_path / "gpt_distributed.py").read_text()
    (tmp_path / "gpt_pp.py").write_text(src.replace(
        '@meshplan.distribute(mesh={"dp": 2}, ',
        '@meshplan.distribute(mesh={"pp": 2, "dp": 2}, microbatches=4, '))
    rc, _, err = _main("run", f"{tmp_path / 'gpt_pp.py'}:train_step", "--plan", str(gp))
    assert rc != 0 and "but train_step's decorator asks microbatches=4" in err, err
    rc, text, err = _main("run", target, "--plan", str(out), "--steps", "2", "--json")
    assert rc == 0, err
    losses = [json.loads(line)["loss"] for line in text.splitlines() if '"step"' in line]
    ex = gpt.build(optimizer="adamw", seed=0)                # the example's model and data
    eager = [float(ex.step(*ex.batch(i)).detach()) for i in range(2)]
    assert torch.allclose(torch.tensor(losses), torch.tensor(eager), rtol=1e-5, atol=0), (
        losses, eager)
    body = json.loads(gp.read_text())
    body["body"]["microbatches"] = 4
    gp.write_text(json.dumps(body))
    rc, _, err = _main("run", target, "--plan", str(gp), "--steps", "1")
    assert rc != 0 and "does not match its content hash" in err
    rc, _, err = _main("compile", target, "--mesh", "dp=2", "--schedule", "1f1b",
                       "-o", str(tmp_path / "x.plan"))
    assert rc != 0 and "--schedule and --microbatches are for a mesh with a pp axis" in err
