"""Readable text for a Plan: the headline numbers, collectives by kind and axis, fallbacks."""

from __future__ import annotations

import io
from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._plan import Plan


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _t(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 10 else f"{s:.2f} s"


def render_summary(plan: Plan, width: int = 100) -> str:
    from rich.console import Console
    from rich.table import Table

    out = io.StringIO()
    con = Console(file=out, width=width, highlight=False, no_color=True)
    st = plan.solver
    con.print(f"plan \\[{plan.strategy}] for {plan.graph.info.name} on mesh {plan.mesh}")
    con.print(f"  estimated step time {_t(plan.estimated_step_time_s)} "
              f"(compute {_t(plan.compute_time_s)}, communication {_t(plan.comm_time_s)})")
    con.print(f"  peak memory per device {format_bytes(plan.peak_memory_bytes)} of "
              f"{format_bytes(plan.memory_limit_bytes)}: "
              f"{'fits' if plan.fits else 'DOES NOT FIT'}")
    if st:
        con.print(f"  solver: {st.get('status')}, gap {float(st.get('mip_gap', 0.0)):.2%}, "
                  f"{st.get('variables')} variables, {st.get('groups')} decisions for "
                  f"{st.get('decisions')} nodes, build {float(st.get('build_s', 0)):.2f} s, "
                  f"solve {float(st.get('solve_s', 0)):.2f} s")
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
            overlap = plan.mesh.topology.comm_overlap
            con.print(f"  gradient all-reduces in buckets of up to {format_bytes(plan.bucket_bytes)}"
                      f" (cost model: {overlap:.0%} of collective time overlaps compute on "
                      f"{plan.mesh.topology.name})")
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
    return out.getvalue()


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
