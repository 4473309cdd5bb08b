"""What the user sees in meshplan's summaries, on the MLP step (traced once per module), through
the same ``main`` the ``meshplan`` command runs, in process.

Pins down: a fully replicated ``auto`` plan says so in ``Plan.summary()``, ``plan show`` and its
``--json``, with the best sharded family's estimate beside it, and a plan file saved before that
comparison still loads and says it is fully replicated; a plan that splits its work says
nothing of the kind; the HTML page's header counts collectives as its table does; ``plan diff``
summarises by part of the step and by collective before listing at most ``LIST_ROWS`` rows of
each (``--all``: every one); ``meshplan --help`` describes meshplan in whole sentences; the
largest-activations table labels backward values by phase, not "in forward"; the README
points at no file the repository does not hold.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
from pathlib import Path
from typing import Any

import meshplan
import pytest
from meshplan.examples import mlp
from meshplan.planner import Plan, plan_graph

REPO = Path(__file__).resolve().parents[2]


def _main(*args: str) -> tuple[int, str, str]:
    from meshplan.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def graph() -> Any:
    ex = mlp.build(optimizer="adamw")
    return meshplan.trace(ex.step, *ex.batch(0)).graph


@pytest.fixture(scope="module")
def auto(graph: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Plan]:
    """The MLP on dp=2 with the cpu topology: too small to gain from splitting, so replicated."""
    plan = plan_graph(graph, {"dp": 2}, topology="cpu", compare_sharded=True)
    path = tmp_path_factory.mktemp("plans") / "auto.plan"
    plan.save(path)
    return path, plan


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_fully_replicated_plan_says_so_with_the_best_sharded_plan(auto: tuple) -> None:
    path, plan = auto
    assert plan.strategy == "auto" and plan.fully_replicated
    alt = plan.sharded_alternatives
    assert alt is not None and {p.strategy for p in alt.plans} == {"dp", "fsdp"}
    assert [s for s, _ in alt.skipped] == ["megatron_tp"]          # no tp axis on this mesh
    best = alt.best
    assert best is not None and best.estimated_step_time_s > plan.estimated_step_time_s
    want = f"best sharded plan: {best.strategy}, estimated step {best.estimated_step_time_s * 1e3:.3f} ms"
    summary = _flat(plan.summary())
    assert "fully replicated: every rank holds all the state and runs the whole batch" in summary
    assert want in summary
    rc, out, err = _main("plan", "show", str(path))
    assert rc == 0, err
    assert "fully replicated" in _flat(out) and want in _flat(out)
    rep = json.loads(_main("plan", "show", str(path), "--json")[1])
    assert rep["fully_replicated"] is True
    assert rep["sharded_alternatives"]["plans"][0]["strategy"] == best.strategy
    assert Plan.load(path).sharded_alternatives == alt
    from meshplan.planner import render_html

    assert "fully replicated" in render_html(plan) and want in _flat(render_html(plan))


def test_a_plan_that_splits_its_work_says_nothing_of_it(graph: Any) -> None:
    plan = plan_graph(graph, {"dp": 2}, topology="cpu", strategy="dp")
    assert not plan.fully_replicated and plan.sharded_alternatives is None
    assert "fully replicated" not in plan.summary()
    assert "sharded_alternatives" not in plan.to_dict()["body"]    # older files hash alike


def test_plan_saved_before_the_comparison_still_loads(auto: tuple, tmp_path: Path) -> None:
    d = json.loads(auto[0].read_text())
    del d["body"]["sharded_alternatives"]
    text = json.dumps(d["body"], sort_keys=True, separators=(",", ":"), allow_nan=False)
    d["sha256"] = hashlib.sha256(text.encode()).hexdigest()
    old = tmp_path / "old.plan"
    old.write_text(json.dumps(d))
    plan = Plan.load(old)
    assert plan.fully_replicated and plan.sharded_alternatives is None
    rc, out, err = _main("plan", "show", str(old))
    assert rc == 0, err
    assert "fully replicated" in out and "not compared with a sharded plan" in _flat(out)


def test_html_header_counts_collectives_as_its_table(graph: Any) -> None:
    from meshplan.planner import render_html

    # megatron_tp on dp=2,tp=2: some layout changes are local slices, with no collective
    plan = plan_graph(graph, {"dp": 2, "tp": 2}, topology="h100", strategy="megatron_tp")
    assert any(not r.collectives for r in plan.redistributions)
    page = render_html(plan)
    head = re.search(r"(\d+)</span> collectives per step", page)
    table = page[page.index("<h2>collectives per step</h2>"):]
    counts = [int(c) for c in re.findall(r"<tr><td>[^<]*</td><td>[^<]*</td><td>(\d+)</td>", table)]
    assert head and counts and int(head.group(1)) == sum(counts)


def test_diff_summarises_before_listing(graph: Any, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from meshplan._cli_plan import LIST_ROWS

    monkeypatch.setenv("COLUMNS", "250")             # whole node names in rich's tables

    a, b = tmp_path / "dp.plan", tmp_path / "fsdp.plan"
    plan_graph(graph, {"dp": 2}, topology="cpu", strategy="dp").save(a)
    plan_graph(graph, {"dp": 2}, topology="cpu", strategy="fsdp").save(b)
    d = json.loads(_main("plan", "diff", str(a), str(b), "--json")[1])
    n = len(d["placements"])
    assert n > LIST_ROWS
    assert sum(p["changed"] for p in d["placements_by_part"]) == n
    assert {t["kind"] for t in d["collective_totals"]} >= {"all_reduce", "all_gather"}
    out = _main("plan", "diff", str(a), str(b))[1]
    summary, listing = out.index("by part of the step"), out.index(f"{n} placements changed (")
    assert summary < out.index("collectives per step, A -> B") < listing
    assert "param inputs" in out and "update ops" in out
    rows = [p["node"] for p in d["placements"]]
    table = out[listing:out.index("collectives only in", listing)]
    shown = [r for r in rows if re.search(rf"\b{re.escape(r)}\b", table)]
    assert len(shown) == LIST_ROWS and "--all lists every one" in table
    every = _main("plan", "diff", str(a), str(b), "--all")[1]
    assert all(re.search(rf"\b{re.escape(r)}\b", every) for r in rows)


def test_top_level_help_is_whole_sentences() -> None:
    from meshplan.cli import build_parser

    text = build_parser().description
    assert text.endswith(".") and text.count(".") >= 2, text
    assert _flat(build_parser().format_help()).count(_flat(text)) == 1


def test_activation_table_labels_backward_values_by_phase(graph: Any) -> None:
    from meshplan.cli import print_summary
    from meshplan.ir import summarize
    from rich.console import Console

    out = io.StringIO()
    print_summary(summarize(graph, top=40), Console(file=out, width=300), graph)
    rows = [line for line in out.getvalue().splitlines() if "aten." in line and "[" in line]
    backward = [r for r in rows if " backward " in r]
    assert backward and any(" forward " in r for r in rows)
    for row in backward:
        assert "in forward" not in row and "backward of " in row, row


def test_readme_stands_alone() -> None:
    """Every file the README names is in the repository; nothing outside it (``../``)."""
    text = (REPO / "README.md").read_text()
    assert "../" not in text and "DESIGN.md" not in text and "STYLE.md" not in text
    tops = ("frontend/", "ir/", "planner/", "backends/", "kernels/", "runtime/", "telemetry/",
            "examples/", "tests/", "benchmarks/")
    named = {m.split(":")[0] for m in re.findall(r"`([^`\s]+)`", text)}
    paths = {p for p in named if p.startswith(tops) or p.endswith(".md")}
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert paths and not missing, missing


def test_replication_lines_say_which_way_the_comparison_went() -> None:
    from meshplan.planner._summary import TIMED_OUT, replication_lines

    def rep(plans: list, skipped: list | None = None) -> dict:
        return {"fully_replicated": True, "strategy": "auto", "estimated_step_time_s": 2e-3,
                "mesh": {"world_size": 4},
                "sharded_alternatives": {"plans": plans, "skipped": skipped or []}}

    def est(name: str, ms: float, fits: bool = True) -> dict:
        return {"strategy": name, "estimated_step_time_s": ms / 1e3, "compute_time_s": 0.0,
                "comm_time_s": 0.0, "peak_memory_bytes": 0, "fits": fits}

    late = [["megatron_tp", f"{TIMED_OUT} (the solver found no plan within 1 s)"]]
    slower = " ".join(replication_lines(rep([est("dp", 3.0), est("fsdp", 5.0)], late)))
    assert "the 4 ranks repeat the same work" in slower
    assert "best sharded plan: dp, estimated step 3.000 ms (1.50x" in slower
    assert "costs more in communication" in slower and "also fsdp 5.000 ms" in slower
    assert "not planned in time: megatron_tp" in slower
    faster = " ".join(replication_lines(rep([est("fsdp", 0.5, fits=False), est("dp", 1.0)])))
    assert "best sharded plan: dp" in faster and "stopped short of it" in faster
    none = " ".join(replication_lines(rep([], [["dp", "batch dim does not divide"]])))
    assert "no sharded plan to compare with (dp: batch dim does not divide)" in none
    assert replication_lines(dict(rep([]), fully_replicated=False)) == []
