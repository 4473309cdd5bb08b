"""Readable text for a Plan: the headline numbers, collectives by kind and axis, fallbacks."""

from __future__ import annotations

import io
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..ir import RANDOM_SEMANTICS, random_nodes

if TYPE_CHECKING:
    from ._plan import Plan


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _t(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 10 else f"{s:.2f} s"


# how ``sharded_families`` starts the reason of a family whose solve ran out of time
TIMED_OUT = "not planned in time"


def replication_lines(rep: dict[str, Any]) -> list[str]:
    """What to say about a fully replicated plan, from its report (``plan_report``'s keys
    ``fully_replicated``, ``sharded_alternatives``, ``estimated_step_time_s``, ``strategy`` and
    ``mesh.world_size``); nothing for a plan that splits its work."""
    if not rep.get("fully_replicated"):
        return []
    step = rep["estimated_step_time_s"]
    lines = [f"fully replicated: every rank holds all the state and runs the whole batch, so "
             f"the {rep['mesh']['world_size']} ranks repeat the same work (no data, tensor or "
             "sharded-state parallelism)"]
    alt = rep.get("sharded_alternatives")
    if alt is None:
        if rep["strategy"] == "auto":
            lines.append("not compared with a sharded plan here (distribute does not wait for "
                         "it; plans with input pins or from an older meshplan carry none): "
                         "meshplan compile, or meshplan.compile, compares the sharded families")
        return lines
    fitting = [p for p in alt["plans"] if p["fits"]] or alt["plans"]
    if not fitting:
        why = "; ".join(f"{f}: {w}" for f, w in alt["skipped"]) or "no family applies"
        lines.append(f"no sharded plan to compare with ({why})")
        return lines
    best = min(fitting, key=lambda p: p["estimated_step_time_s"])
    t = best["estimated_step_time_s"]
    head = (f"best sharded plan: {best['strategy']}, estimated step {_t(t)} "
            f"({t / max(step, 1e-15):.2f}x this plan's {_t(step)})")
    if not best["fits"]:
        head += ", over the memory limit"
    if t >= step:
        head += ("; under this cost model splitting the step costs more in communication than "
                 "it saves in compute")
    else:
        head += (f"; the automatic search stopped short of it (time limit or gap): raise "
                 f"time_limit_s or use strategy={best['strategy']!r}")
    others = [p for p in alt["plans"] if p is not best]
    if others:
        head += "; also " + ", ".join(f"{p['strategy']} {_t(p['estimated_step_time_s'])}"
                                      for p in others)
    late = [f for f, why in alt["skipped"] if why.startswith(TIMED_OUT)]
    if late:
        head += f"; not planned in time: {', '.join(late)}"
    lines.append(head)
    return lines


def random_ops_line(targets: Sequence[str]) -> str | None:
    """What to say about a step's random ops (their targets; None without any)."""
    if not targets:
        return None
    kinds = ", ".join(f"{t} x{n}" for t, n in Counter(targets).most_common())
    n = len(targets)
    return f"{n} random op{'s' * (n != 1)} ({kinds}); {RANDOM_SEMANTICS}"


# the planner's notes in ``Plan.solver`` (sentences, not stats) and how reports label them
SOLVER_NOTES = (("axis_order", "axis order"), ("recompute", "activation recompute"),
                ("families", "search vs families"), ("device", "device"),
                ("fault_tolerance", "fault tolerance"), ("microbatches", "micro-batches"),
                ("pipeline", "pipeline"))


def render_summary(plan: Plan, width: int = 100) -> str:
    from rich.console import Console
    from rich.table import Table

    out = io.StringIO()
    con = Console(file=out, width=width, highlight=False, no_color=True)
    st = plan.solver
    con.print(f"plan \\[{plan.strategy}] for {plan.graph.info.name} on mesh {plan.mesh}")
    con.print(f"  estimated step time {_t(plan.estimated_step_time_s)} "
              f"(compute {_t(plan.compute_time_s)}, communication {_t(plan.comm_time_s)})")
    for line in replication_lines(_replication_report(plan)):
        con.print(f"  {line}", markup=False)
    con.print(f"  peak memory per device {format_bytes(plan.peak_memory_bytes)} of "
              f"{format_bytes(plan.memory_limit_bytes)}: "
              f"{'fits' if plan.fits else 'DOES NOT FIT'}")
    if st:
        con.print(f"  solver: {st.get('status')}, gap {float(st.get('mip_gap', 0.0)):.2%}, "
                  f"{st.get('variables')} variables, {st.get('groups')} decisions for "
                  f"{st.get('decisions')} nodes, build {float(st.get('build_s', 0)):.2f} s, "
                  f"solve {float(st.get('solve_s', 0)):.2f} s")
    for key, label in SOLVER_NOTES:
        if st.get(key):
            con.print(f"  {label}: {st[key]}", markup=False)
    agg: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for r in plan.redistributions:
        for kind, axis, nbytes in r.collectives:
            a = agg[(kind, axis)]
            a[0] += r.count
            a[1] += nbytes * r.count
        if r.collectives:
            agg[(r.collectives[0][0], r.collectives[0][1])][2] += r.time_s * r.count
    if agg:
        table = Table(title="collectives per step")
        for col in ("collective", "axis", "count", "bytes", "time"):
            table.add_column(col, justify="left" if col in ("collective", "axis") else "right")
        for (kind, axis), (count, nbytes, t) in sorted(agg.items(), key=lambda kv: -kv[1][2]):
            table.add_row(kind, axis, str(int(count)), format_bytes(nbytes), _t(t))
        con.print(table)
        if plan.bucket_bytes is not None:
            from ._planning import reduction_buckets

            overlap = plan.mesh.topology.comm_overlap
            buckets = reduction_buckets(plan.graph, plan.mesh, plan.redistributions,
                                        plan.bucket_bytes)
            merged = sum(len({plan.redistributions[i].value for i in b.members})
                         for b in buckets)
            cap = format_bytes(plan.bucket_bytes)
            con.print(f"  all-reduces in buckets of up to {cap} as the lowering merges them: "
                      f"{merged} run as {len(buckets)} calls, priced so (the table prices each "
                      f"alone); "
                      f"{overlap:.0%} of a bucket's wire time "
                      f"overlaps compute on {plan.mesh.topology.name}")
    else:
        con.print("  no communication")
    params = _param_layouts(plan)
    if params:
        table = Table(title="parameter layouts (" + ", ".join(plan.mesh.names) + ")")
        table.add_column("layout")
        table.add_column("parameters", justify="right")
        table.add_column("bytes", justify="right")
        table.add_column("e.g.")
        for layout, (count, nbytes, example) in sorted(params.items(), key=lambda kv: -kv[1][1]):
            table.add_row(layout, str(count), format_bytes(nbytes), example)
        con.print(table)
    if plan.fallbacks:
        con.print(f"  ops without a sharding rule (run replicated): {', '.join(plan.fallbacks)}")
    random_line = random_ops_line([n.target for n in random_nodes(plan.graph)])
    if random_line:
        con.print(f"  {random_line}", markup=False)
    return out.getvalue()


def _replication_report(plan: Plan) -> dict[str, Any]:
    alt = plan.sharded_alternatives
    return {"fully_replicated": plan.fully_replicated, "strategy": plan.strategy,
            "estimated_step_time_s": plan.estimated_step_time_s,
            "mesh": {"world_size": plan.mesh.size},
            "sharded_alternatives": None if alt is None else alt.to_dict()}


def _param_layouts(plan: Plan) -> dict[str, list]:
    from ..ir import Role
    from ._plan import layout_str

    by: dict[str, list] = {}
    placed = {p.node: p for p in plan.placements}
    for n in plan.graph.inputs_with_role(Role.PARAM):
        p = placed.get(n.name)
        if p is None:
            continue
        key = layout_str(p.outputs[0])
        acc = by.setdefault(key, [0, 0, n.target])
        acc[0] += 1
        acc[1] += n.meta.nbytes
    return by
