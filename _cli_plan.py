"""``meshplan plan show|explain|diff``: reading, explaining and comparing saved plans."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ._errors import PlanError

# rows ``plan diff`` lists of each kind of change before saying how many more there are
LIST_ROWS = 20


def add_plan_commands(sub: argparse._SubParsersAction) -> None:
    """Register the ``plan`` command group."""
    p = sub.add_parser("plan", help="read, explain and compare saved plans")
    ps = p.add_subparsers(dest="plan_command", required=True)

    show = ps.add_parser("show", help="placements per layer, collectives, time, memory, solver")
    show.add_argument("plan", help="a .plan file from `meshplan compile`")
    out = show.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="the documented plan-report schema")
    out.add_argument("--html", metavar="OUT.html", help="write one self-contained offline page")
    show.set_defaults(func=cmd_plan_show)

    ex = ps.add_parser("explain", help="why a node runs with its layout, and its alternatives; "
                                       "for a pipeline plan, why its stage split")
    ex.add_argument("plan")
    ex.add_argument("--node", help="node name (see `plan show --json`); required but for a "
                                   "pipeline plan, whose split is explained without it")
    ex.add_argument("--json", action="store_true")
    ex.set_defaults(func=cmd_plan_explain)

    d = ps.add_parser("diff", help="what changed between two plans")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--json", action="store_true")
    d.add_argument("--all", action="store_true",
                   help=f"list every changed placement and collective (default: the first "
                        f"{LIST_ROWS} of each, after the summary)")
    d.set_defaults(func=cmd_plan_diff)


def _load(path: str) -> Any:
    from .planner import Plan

    return Plan.load(path)


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)


def _ms(s: float | None) -> str:
    if s is None:
        return "impossible"
    return f"{s * 1e3:.4f} ms" if s < 10 else f"{s:.2f} s"


def _table(title: str, cols: tuple[str, ...], rows: list[tuple], right: tuple[str, ...] = ()) -> Any:
    from rich.table import Table

    t = Table(title=title)
    for c in cols:
        t.add_column(c, justify="right" if c in right else "left")
    for r in rows:
        t.add_row(*(str(x) for x in r))
    return t


# ---- show ----------------------------------------------------------------------------------------

def show_data(path: str) -> dict[str, Any]:
    """What ``plan show --json`` prints of the plan file ``path`` (``meshplan serve`` too):
    the plan report with its kernels; a pipeline plan's stages beside its inner plan's."""
    from .backends._kernels import kernels_report
    from .planner import PipelinePlan, plan_report
    from .planner._pipeline import is_pipeline_file

    if is_pipeline_file(path):
        pplan = PipelinePlan.load(path)
        rep = plan_report(pplan.inner)
        rep["kernels"] = kernels_report(pplan.inner)
        body = pplan.to_dict()
        del body["inner_plan"]
        return {"pipeline": body, "inner": rep}
    plan = _load(path)
    rep = plan_report(plan)
    rep["kernels"] = kernels_report(plan)
    return rep


def explain_data(path: str, node: str | None) -> dict[str, Any]:
    """What ``plan explain --json`` prints: why ``node`` got its layout (with its stage, in a
    pipeline plan), or without a node a pipeline plan's stage split."""
    from .planner import explain
    from .planner._pipeline import is_pipeline_file

    if is_pipeline_file(path):
        from .planner import PipelinePlan
        from .planner._pipeline_explain import explain_pipeline

        pplan = PipelinePlan.load(path)
        if not node:
            return explain_pipeline(pplan)
        ex = explain(pplan.inner, node)
        ex["stage"] = _stage_of_node(pplan, node)
        return ex
    if not node:
        raise PlanError(f"meshplan plan explain {path}: name the node to explain with "
                        "--node NAME (`meshplan plan show --json` lists them); only a pipeline "
                        "plan is explained without one (its stage split)")
    return explain(_load(path), node)


def cmd_plan_show(args: argparse.Namespace) -> int:
    from .planner import plan_report, render_html

    from .planner._pipeline import is_pipeline_file

    if args.json:
        print(json.dumps(show_data(args.plan), indent=2, allow_nan=False))
        return 0
    if is_pipeline_file(args.plan):
        return _show_pipeline(args)
    plan = _load(args.plan)
    if args.html:
        return _write_html(args.html, render_html(plan))
    rep = plan_report(plan)
    from .backends._kernels import kernels_report

    rep["kernels"] = kernels_report(plan)
    print_report(rep)
    return 0


def _write_html(path: str, page: str) -> int:
    """``plan show --html PATH``: the page written atomically, into a folder that exists."""
    from .ir import atomic_write_text

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise PlanError(f"--html {path}: folder {folder} does not exist; create it first")
    atomic_write_text(path, page)
    _console().print(f"wrote {path}")
    return 0


def _show_pipeline(args: argparse.Namespace) -> int:
    """A pipeline plan: its stages, schedule and estimates, then the report of the inner
    plan (every stage's layouts on the mesh without ``pp``)."""
    from .backends._kernels import kernels_report
    from .planner import PipelinePlan, plan_report

    pplan = PipelinePlan.load(args.plan)
    if args.html:
        from .planner._pipeline_explain import render_pipeline_html

        return _write_html(args.html, render_pipeline_html(pplan))
    rep = plan_report(pplan.inner)
    rep["kernels"] = kernels_report(pplan.inner)
    console = _console()
    console.print(pplan.summary())
    console.print(pplan.schedule_text())
    console.print(f"\nevery stage's layouts (the plan on "
                  f"{','.join(f'{a}={n}' for a, n in pplan.inner.mesh.axes)}):")
    print_report(rep, console)
    return 0


def print_report(rep: dict[str, Any], console: Any = None) -> None:
    from .planner._summary import format_bytes as fb
    from .planner._summary import random_ops_line, replication_lines

    con = console or _console()
    mesh = ",".join(f"{a}={n}" for a, n in rep["mesh"]["axes"])
    con.print(f"[bold]plan \\[{rep['strategy']}][/bold] for {rep['graph']} on mesh {mesh} "
              f"({rep['mesh']['topology']}, {rep['mesh']['world_size']} ranks)")
    con.print(f"  estimated step time {_ms(rep['estimated_step_time_s'])} (compute "
              f"{_ms(rep['compute_time_s'])}, communication {_ms(rep['comm_time_s'])})")
    for line in replication_lines(rep):
        con.print(f"  {line}", markup=False)
    con.print(f"  peak memory per rank {fb(rep['peak_memory_bytes'])} of "
              f"{fb(rep['memory_limit_bytes'])}: {'fits' if rep['fits'] else 'DOES NOT FIT'}")
    names = ", ".join(rep["mesh"]["names"])
    con.print(_table(f"placements per layer ({names})", ("layer", "nodes", "compute", "parameters"),
                     [(l["layer"], l["nodes"], _ms(l["compute_s"]),
                       "; ".join(f"{k} {' | '.join(v)}" for k, v in l["params"].items()) or "-")
                      for l in rep["layers"]], right=("nodes", "compute")))
    if rep["collectives"]:
        con.print(_table("collectives per step", ("value", "consumer", "src", "dst",
                                                  "collective", "axis", "bytes", "time"),
                         [(c["value"], c["consumer"], c["src"], c["dst"],
                           " + ".join(s[0] for s in c["steps"]),
                           " + ".join(s[1] for s in c["steps"]),
                           " + ".join(fb(s[2]) for s in c["steps"]),
                           _ms(c["time_s"]) + (f" x{c['count']}" if c["count"] > 1 else ""))
                          for c in rep["collectives"]], right=("bytes", "time")))
    else:
        con.print("  no communication")
    m = rep["memory"]
    con.print(_table("memory per rank at the peak (every rank holds the same)",
                     ("parameters", "gradients", "optimizer state", "buffers", "activations",
                      "peak", "limit"),
                     [tuple(fb(m[k]) for k in ("parameters_bytes", "gradients_bytes",
                                               "optimizer_state_bytes", "buffers_bytes",
                                               "activations_bytes", "peak_bytes",
                                               "limit_bytes"))]))
    k = rep.get("kernels")
    if k and k["kernels"]:
        con.print(_table(f"kernels the lowering substitutes (rank {k['rank']}, {k['device']})",
                         ("kernel", "backend", "calls", "updates", "replaces nodes", "what"),
                         [(r["kernel"], r["backend"], r["calls"], r["updates"],
                           r["replaced_nodes"], r["doc"]) for r in k["kernels"]],
                         right=("calls", "updates", "replaces nodes")))
    elif k:
        con.print(f"  kernels: none on {k['device']}"
                  + ("" if k["enabled"] else " (switched off: MESHPLAN_KERNELS=off)"))
    if rep["fallbacks"]:
        con.print(f"  ops without a sharding rule (run replicated): {', '.join(rep['fallbacks'])}")
    else:
        con.print("  fallbacks: none (every op has a sharding rule)")
    random_line = random_ops_line([r["target"] for r in rep.get("random_ops", ())])
    if random_line:
        con.print(f"  {random_line}", markup=False)
    st = dict(rep["solver"])
    from .planner._summary import SOLVER_NOTES

    notes = [(label, st.pop(key)) for key, label in SOLVER_NOTES if st.get(key)]
    if st:
        con.print("  solver: " + ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in st.items()))
    for label, note in notes:
        con.print(f"  {label}: {note}", markup=False)


# ---- explain -------------------------------------------------------------------------------------

def cmd_plan_explain(args: argparse.Namespace) -> int:
    from .planner import explain
    from .planner._pipeline import is_pipeline_file

    if args.json:
        print(json.dumps(explain_data(args.plan, args.node), indent=2, allow_nan=False))
        return 0
    where = ""
    if is_pipeline_file(args.plan):
        from .planner import PipelinePlan
        from .planner._pipeline_explain import explain_pipeline, explain_pipeline_text

        pplan = PipelinePlan.load(args.plan)
        if not args.node:
            print(explain_pipeline_text(explain_pipeline(pplan)), flush=True)
            return 0
        plan = pplan.inner
        where = _stage_of_node(pplan, args.node)
    elif not args.node:
        raise PlanError(f"meshplan plan explain {args.plan}: name the node to explain with "
                        "--node NAME (`meshplan plan show --json` lists them); only a pipeline "
                        "plan is explained without one (its stage split)")
    else:
        plan = _load(args.plan)
    ex = explain(plan, args.node)
    con = _console()
    if where:
        con.print(f"  {where}", markup=False)
    con.print(f"[bold]{ex['node']}[/bold] ({ex['target']}, {ex['phase']}"
              f"{', ' + ex['module'] if ex['module'] else ''}) at {ex['source'] or '?'}")
    con.print(f"  {ex['why']}")
    if ex.get("recompute"):
        con.print(f"  {ex['recompute']}", markup=False)
    rows = [("*" if r["chosen"] else "", " ".join(r["inputs"]) or "-", " ".join(r["outputs"]),
             _ms(r["compute_s"] + r["folded_comm_s"]), _ms(r["input_reshard_s"]),
             _ms(r["output_reshard_s"]), _ms(r["total_s"]), r["output_bytes_per_rank"])
            for r in ex["alternatives"]]
    con.print(_table("choices (priced holding every other node at its chosen layout)",
                     ("", "inputs", "outputs", "compute", "in reshard", "out reshard", "total",
                      "out bytes/rank"), rows,
                     right=("compute", "in reshard", "out reshard", "total", "out bytes/rank")))
    others = [r for r in ex["alternatives"] if not r["chosen"]]
    for label, r in (("chosen", ex["chosen"]), ("next", others[0] if others else None)):
        if r is None:
            continue
        con.print(f"  layout changes of the {label} choice {' '.join(r['outputs'])}:")
        for e in r["reshards"] or [{"direction": "", "value": "none", "other": "", "src": "",
                                    "dst": "", "steps": [], "time_s": 0.0}]:
            steps = " + ".join(f"{k} on {ax} {b} B" for k, ax, b in e["steps"] or [])
            con.print(f"    {e['direction']} {e['value']} -> {e['other']} {e['src']} -> "
                      f"{e['dst']}: {steps or '-'} ({_ms(e['time_s'])})")
    return 0


def _stage_of_node(pplan: Any, node: str) -> str:
    """Where a node of a pipeline plan's inner plan runs: its chunk and stage."""
    from .planner._pipeline import unit_map

    _, unit = unit_map(pplan.inner.graph)
    u = unit.get(node)
    for c, chunk in enumerate(pplan.chunks):
        if u in chunk:
            return (f"on stage {c % pplan.pp}" + (f" (chunk {c})" if pplan.virtual_stages > 1
                                                  else "") + f", with unit {u}; its layout is "
                    "the inner plan's, on every stage's ranks alike")
    return "on every stage (the step's data, hyper-parameters or constants)"


# ---- diff ----------------------------------------------------------------------------------------

def _arrow(x: object, y: object) -> str:
    return str(x) if x == y else f"{x} -> {y}"


def _listed(n: int, what: str, cap: int | None) -> str:
    if cap is None or n <= cap:
        return f"{n} {what}"
    return f"{n} {what} (the first {cap}; --all lists every one, --json has them all)"


def cmd_plan_diff(args: argparse.Namespace) -> int:
    from .planner import diff
    from .planner._pipeline import is_pipeline_file

    pipes = [is_pipeline_file(args.a), is_pipeline_file(args.b)]
    if any(pipes):
        return _diff_pipelines(args, pipes)
    d = diff(_load(args.a), _load(args.b))
    if not _said(d, args, "plans are identical in placements, collectives, time and memory"):
        _print_diff(d, _console(), None if args.all else LIST_ROWS)
    return 0


def _said(d: dict[str, Any], args: argparse.Namespace, same: str) -> bool:
    """A diff printed whole as JSON (``--json``), or ``same`` when nothing changed: True;
    False when the caller prints the changes."""
    if args.json:
        print(json.dumps(d, indent=2, allow_nan=False))
        return True
    if d["identical"]:
        _console().print(same)
        return True
    return False


def _diff_pipelines(args: argparse.Namespace, pipes: list[bool]) -> int:
    """``plan diff`` of two pipeline plans: the stages and schedule, then the layouts."""
    from .planner import PipelinePlan
    from .planner._pipeline_explain import diff_pipeline
    from .planner._summary import format_bytes as fb

    if not all(pipes):
        one, other = (args.a, args.b) if pipes[0] else (args.b, args.a)
        raise PlanError(f"meshplan plan diff: {one} is a pipeline plan (a 'pp' mesh axis) and "
                        f"{other} is not; compare pipeline plans with each other, or compile "
                        "both for the same kind of mesh")
    d = diff_pipeline(PipelinePlan.load(args.a), PipelinePlan.load(args.b))
    if _said(d, args, "pipeline plans are identical in stages, schedule, layouts, time and "
                      "memory"):
        return 0
    con = _console()
    for key in ("mesh", "schedule", "microbatches", "virtual_stages", "keep_params"):
        if d[key]:
            con.print(f"  {key.replace('_', ' ')}: {d[key]['before']} -> {d[key]['after']}",
                      markup=False)
    for key, label in (("estimated_step_time_s", "step time"), ("bubble_s", "bubble"),
                       ("p2p_s", "p2p"), ("update_s", "once a step")):
        v = d[key]
        con.print(f"  {label}: {_ms(v['a'])} -> {_ms(v['b'])} ({v['delta'] * 1e3:+.4f} ms)")
    v = d["peak_memory_bytes"]
    sign = "+" if v["delta"] >= 0 else "-"
    con.print(f"  peak memory per device: {fb(int(v['a']))} -> {fb(int(v['b']))} "
              f"({sign}{fb(int(abs(v['delta'])))})")
    if d["units_moved"]:
        con.print(_table(f"{len(d['units_moved'])} units on another stage",
                         ("unit", "stage before", "stage after"),
                         [(m["unit"], "-" if m["before"] is None else m["before"],
                           "-" if m["after"] is None else m["after"])
                          for m in d["units_moved"]]))
    elif d["chunks"]:
        con.print("  the same units on each stage, in other chunks")
    if d["inner"]["identical"]:
        con.print("  every stage's layouts: identical")
    else:
        con.print("every stage's layouts (the inner plans):")
        _print_diff(d["inner"], con, None if args.all else LIST_ROWS)
    return 0


def _print_diff(d: dict[str, Any], con: Any, cap: int | None) -> None:
    from .planner._summary import format_bytes as fb
    for key in ("mesh", "strategy", "bucket_bytes"):
        if d[key]:
            con.print(f"  {key}: {d[key]['before']} -> {d[key]['after']}")
    for key, label in (("estimated_step_time_s", "step time"), ("compute_time_s", "compute"),
                       ("comm_time_s", "communication")):
        v = d[key]
        con.print(f"  {label}: {_ms(v['a'])} -> {_ms(v['b'])} ({v['delta'] * 1e3:+.4f} ms)")
    v = d["peak_memory_bytes"]
    sign = "+" if v["delta"] >= 0 else "-"
    con.print(f"  peak memory: {fb(v['a'])} -> {fb(v['b'])} ({sign}{fb(abs(v['delta']))})")
    if d["placements_by_part"]:
        con.print(_table(f"{len(d['placements'])} placements changed, by part of the step",
                         ("part", "changed", "of", "most common changes of output layout"),
                         [(r["part"], r["changed"], r["of"],
                           "; ".join(f"{w} x{n}" for w, n in r["changes"][:3])
                           + (f"; {len(r['changes']) - 3} more" if len(r["changes"]) > 3
                              else "")) for r in d["placements_by_part"]],
                         right=("changed", "of")))
    if d["collective_totals"]:
        con.print(_table("collectives per step, A -> B", ("collective", "axis", "count", "bytes",
                                                          "time"),
                         [(t["kind"], t["axis"], _arrow(t["count_a"], t["count_b"]),
                           _arrow(fb(t["bytes_a"]), fb(t["bytes_b"])),
                           _arrow(_ms(t["time_a_s"]), _ms(t["time_b_s"])))
                          for t in d["collective_totals"]], right=("count", "bytes", "time")))
    if d["placements"]:
        con.print(_table(_listed(len(d["placements"]), "placements changed", cap),
                         ("node", "op", "before", "after"),
                         [(p["node"], p["target"], ", ".join(p["before"]), ", ".join(p["after"]))
                          for p in d["placements"][:cap]]))
    for key, label in (("collectives_only_in_a", "only in A"), ("collectives_only_in_b",
                                                                "only in B")):
        if d[key]:
            con.print(_table(_listed(len(d[key]), f"collectives {label}", cap),
                             ("value", "consumer", "src", "dst", "steps", "time"),
                             [(c["value"], c["consumer"], c["src"], c["dst"],
                               " + ".join(f"{k}/{ax} {fb(b)}" for k, ax, b in c["steps"]),
                               _ms(c["time_s"])) for c in d[key][:cap]]))
    for key in ("nodes_only_in_a", "nodes_only_in_b"):
        if d[key]:
            con.print(f"  {key.replace('_', ' ')}: {', '.join(d[key][:20])}"
                      + (" ..." if len(d[key]) > 20 else ""))
