"""Why a pipeline plan splits the layers where it does (``meshplan plan explain pp.plan``),
what changed between two of them (``meshplan plan diff a.plan b.plan``), and its page
(``meshplan plan show pp.plan --html``).

``plan_pipeline`` cuts the step's units (``<pre>``, the repeated layers, ``<post>``) into
``pp x virtual_stages`` contiguous chunks so that the slowest chunk's time per micro-batch is
least and every device's memory fits, then keeps the fastest schedule, micro-batch count and
chunks per device of those it tried. ``explain_pipeline`` says so with the plan's own
numbers, re-derived from the inner plan the file carries (``units_of``):

- every unit's forward and backward per micro-batch and its state, and every chunk's sum,
  the slowest chunk named;
- each cut moved one unit earlier and one later, priced as the planner prices a split (the
  schedule run event by event: ``simulate``), so that a reader sees what the neighbouring
  splits would cost, and which of them would not fit;
- the schedules, micro-batch counts and chunks per device that were tried, fastest first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._pipeline import POST, PP_AXIS, PRE, PipelinePlan, _price, units_of
from ._problem import PlanError
from ._summary import format_bytes


def explain_pipeline(plan: PipelinePlan) -> dict[str, Any]:
    """A pipeline plan's split, its neighbours and the schedules tried (the module
    docstring), as plain data (``meshplan plan explain --json``)."""
    raw, crossing = units_of(plan.inner)
    units = raw
    names = [u.name for u in units]
    flat = [u for chunk in plan.chunks for u in chunk]
    if flat != names:
        raise PlanError(f"the pipeline plan's chunks ({len(flat)} units) do not match the units "
                        f"of its inner plan ({len(names)}): the file is not one meshplan wrote; "
                        "compile it again")
    p, v, m = plan.pp, plan.virtual_stages, plan.microbatches
    if not plan.keep_params:             # as _price prices them: paid by every micro-batch
        units = [dataclasses.replace(u, fwd_s=u.fwd_s + m * u.fixed_fwd_s,
                                     bwd_s=u.bwd_s + m * u.fixed_bwd_s, fixed_fwd_s=0.0,
                                     fixed_bwd_s=0.0) for u in units]
    by_name = {u.name: u for u in units}

    def per_mb(us: Any) -> float:
        return sum((u.fwd_s + u.bwd_s + u.fixed_fwd_s + u.fixed_bwd_s) / m for u in us)

    chunks = []
    for c, chunk in enumerate(plan.chunks):
        us = [by_name[n] for n in chunk]
        chunks.append({
            "chunk": c, "device": c % p, "units": list(chunk),
            "layers": sum(n not in (PRE, POST) for n in chunk),
            "time_per_microbatch_s": per_mb(us),
            "fwd_s": sum(u.fwd_s for u in us) / m, "bwd_s": sum(u.bwd_s for u in us) / m,
            "state_bytes": sum(u.state_bytes for u in us),
            "boundary_bytes": plan.boundary_bytes[c] if c < len(plan.boundary_bytes) else 0.0})
    slowest = max(chunks, key=lambda x: x["time_per_microbatch_s"])
    starts, k = [], 0
    for chunk in plan.chunks[:-1]:
        k += len(chunk)
        starts.append(k)
    link = plan.mesh.link(plan.mesh.index(PP_AXIS))
    limit = plan.memory_limit_bytes

    def priced(cuts: list[int]) -> Any:
        return _price(plan.mesh, plan.inner, raw, crossing, p,
                      plan.schedule, m, v, limit, link, plan.keep_params, exact=True,
                      cuts=cuts)

    this = priced(starts)
    base_s = this.estimated_step_time_s if this is not None else plan.estimated_step_time_s
    moves = []
    for b, at in enumerate(starts):
        for delta in (-1, 1):
            cuts = list(starts)
            cuts[b] = at + delta
            bounds = [0, *cuts, len(names)]
            parts = [names[bounds[c]:bounds[c + 1]] for c in range(len(bounds) - 1)]
            if any(not any(n not in (PRE, POST) for n in part) for part in parts):
                continue                     # each chunk holds a layer
            got = priced(cuts)
            if got is None:
                continue
            moved = names[at - 1] if delta < 0 else names[at]
            moves.append({
                "cut": b, "after": names[at - 1], "delta": delta,
                "moves": moved, "to_chunk": b + 1 if delta < 0 else b,
                "step_time_s": got.estimated_step_time_s,
                "vs_plan": got.estimated_step_time_s / base_s - 1 if base_s else 0.0,
                "slowest_chunk_s": max(per_mb([by_name[n] for n in part]) for part in parts),
                "peak_memory_bytes": got.peak_memory_bytes, "fits": got.fits})
    tried = [dataclasses.asdict(t) | {"chosen": (t.inner, t.schedule, t.microbatches,
                                                 t.virtual_stages, t.keep_params)
                                      == (plan.inner.strategy, plan.schedule, m, v,
                                          plan.keep_params)}
             for t in plan.tried]
    better = [x for x in moves if x["step_time_s"] < base_s * (1 - 1e-9)]
    why = (f"{p} stages x {v} chunk{'s' * (v > 1)} per device: the split makes the slowest "
           f"chunk's time per micro-batch least (chunk {slowest['chunk']} on stage "
           f"{slowest['device']}, {_ms(slowest['time_per_microbatch_s'])}) with every device "
           f"within {format_bytes(limit)}")
    if better:
        best = min(better, key=lambda x: x["step_time_s"])
        why += (f"; moving {best['moves']} to chunk {best['to_chunk']} would run "
                f"{-best['vs_plan']:.1%} faster by the event-by-event schedule"
                + ("" if best["fits"] else ", but would not fit")
                + " (the split is chosen by the slowest chunk, the schedule's step time "
                  "also counts the transfers and the warm-up)")
    return {"mesh": dict(plan.mesh.axes), "schedule": plan.schedule, "microbatches": m,
            "virtual_stages": v, "keep_params": plan.keep_params,
            "estimated_step_time_s": base_s, "memory_limit_bytes": limit,
            "chunks": chunks, "slowest_chunk": slowest["chunk"], "moves": moves,
            "tried": tried, "why": why}


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


def explain_pipeline_text(ex: dict[str, Any]) -> str:
    """``explain_pipeline``'s answer as the lines ``meshplan plan explain`` prints."""
    lines = [f"why this split: {ex['why']}", "",
             "chunks (forward + backward per micro-batch, with a share of the parameters' casts "
             "and gathers: what the split balances):"]
    for c in ex["chunks"]:
        ls = [u for u in c["units"] if u not in (PRE, POST)]
        span = f"{ls[0]} .. {ls[-1]}" if len(ls) > 1 else ls[0]
        extra = [u for u in c["units"] if u in (PRE, POST)]
        mark = "  <- slowest" if c["chunk"] == ex["slowest_chunk"] else ""
        lines.append(f"  chunk {c['chunk']:>2} on stage {c['device']:>2}: {c['layers']} "
                     f"layer{'s' * (c['layers'] != 1)} ({span})"
                     + (f" + {' '.join(extra)}" if extra else "")
                     + f"  {_ms(c['time_per_microbatch_s'])}  state "
                     f"{format_bytes(int(c['state_bytes']))}"
                     + (f"  then {format_bytes(int(c['boundary_bytes']))} per micro-batch "
                        "to the next" if c["boundary_bytes"] else "") + mark)
    lines += ["", f"neighbouring splits (each cut moved by one unit; the plan: "
                  f"{_ms(ex['estimated_step_time_s'])} a step):"]
    if not ex["moves"]:
        lines.append("  none: every chunk holds one layer")
    for x in ex["moves"]:
        lines.append(f"  {x['moves']} to chunk {x['to_chunk']}: {_ms(x['step_time_s'])} "
                     f"({x['vs_plan']:+.1%}), slowest chunk {_ms(x['slowest_chunk_s'])}, "
                     f"peak {format_bytes(int(x['peak_memory_bytes']))}"
                     + ("" if x["fits"] else "  DOES NOT FIT"))
    if ex["tried"]:
        lines += ["", "schedules tried (fastest first; * the plan):"]
        for t in ex["tried"][:10]:
            lines.append(f"  {'*' if t['chosen'] else ' '} {t['schedule']:<11} "
                         f"m={t['microbatches']}"
                         + (f" v={t['virtual_stages']}" if t["virtual_stages"] > 1 else "")
                         + ("" if t["keep_params"] else " regather")
                         + f"  {_ms(t['step_time_s'])} (bubble {_ms(t['bubble_s'])}, p2p "
                         f"{_ms(t['p2p_s'])}), peak {format_bytes(int(t['peak_memory_bytes']))}"
                         + ("" if t["fits"] else "  DOES NOT FIT"))
    return "\n".join(lines)


def diff_pipeline(a: PipelinePlan, b: PipelinePlan) -> dict[str, Any]:
    """What changed between two pipeline plans: the mesh, the schedule, its micro-batches and
    chunks per device, how parameters are gathered, which units each stage holds, and the
    estimates; the layouts inside the stages are ``planner.diff`` of the two inner plans."""
    from ._report import diff

    def changed(x: Any, y: Any) -> dict[str, Any] | None:
        return None if x == y else {"before": x, "after": y}

    def stage_units(plan: PipelinePlan) -> list[list[str]]:
        return [[u for c in range(d, len(plan.chunks), plan.pp) for u in plan.chunks[c]]
                for d in range(plan.pp)]

    sa, sb = stage_units(a), stage_units(b)
    moved = []
    where_a = {u: d for d, us in enumerate(sa) for u in us}
    where_b = {u: d for d, us in enumerate(sb) for u in us}
    for u in [*where_a, *(u for u in where_b if u not in where_a)]:
        if where_a.get(u) != where_b.get(u):
            moved.append({"unit": u, "before": where_a.get(u), "after": where_b.get(u)})
    out: dict[str, Any] = {
        "mesh": changed(dict(a.mesh.axes), dict(b.mesh.axes)),
        "schedule": changed(a.schedule, b.schedule),
        "microbatches": changed(a.microbatches, b.microbatches),
        "virtual_stages": changed(a.virtual_stages, b.virtual_stages),
        "keep_params": changed(a.keep_params, b.keep_params),
        "chunks": changed([list(c) for c in a.chunks], [list(c) for c in b.chunks]),
        "units_moved": moved,
    }
    for key in ("estimated_step_time_s", "bubble_s", "p2p_s", "update_s", "peak_memory_bytes"):
        x, y = getattr(a, key), getattr(b, key)
        out[key] = {"a": x, "b": y, "delta": y - x}
    out["inner"] = diff(a.inner, b.inner)
    out["identical"] = (not any(out[k] for k in ("mesh", "schedule", "microbatches",
                                                  "virtual_stages", "keep_params", "chunks"))
                        and out["inner"]["identical"]
                        and all(out[k]["delta"] == 0 for k in (
                            "estimated_step_time_s", "peak_memory_bytes")))
    return out


_KIND_COLOUR = {"F": "#4e79a7", "B": "#f28e2b", "W": "#59a14f"}


def render_pipeline_html(plan: PipelinePlan) -> str:
    """ONE self-contained offline page of a pipeline plan: its estimates, the schedule drawn
    one row per stage (forward, backward, weight gradient and idle, to scale, from
    ``simulate``), the stages and what was tried, then every stage's layouts (the inner
    plan's sections of ``render_html``). Inline CSS and SVG only."""
    from ._pipeline import idle_share, simulate
    from ._report import (_CSS, _esc, _html_collectives, _html_graph, _html_memory,
                          _html_timeline, plan_report)

    m, v, p = plan.microbatches, plan.virtual_stages, plan.pp
    span, timeline = simulate(plan.schedule, [s.fwd_s for s in plan.stages],
                              [s.bwd_s for s in plan.stages], m, v)
    width, row = 800.0, 24
    rects = []
    for d, events in enumerate(timeline):
        y = d * row
        rects.append(f"<text x='0' y='{y + 15}'>stage {d}</text><rect x='70' y='{y}' "
                     f"width='{width:.0f}' height='{row - 4}' fill='#eee'/>")
        for start, end, label in events:
            x = 70 + width * start / span
            w = max(width * (end - start) / span, 0.5)
            rects.append(f"<rect x='{x:.2f}' y='{y}' width='{w:.2f}' height='{row - 4}' "
                         f"fill='{_KIND_COLOUR.get(label[0], '#999')}' stroke='#fff' "
                         f"stroke-width='0.5'><title>{_esc(label)} {start * 1e3:.3f}-"
                         f"{end * 1e3:.3f} ms</title></rect>")
    idle = idle_share(span, timeline)
    legend = "".join(f"<span style='background:{c}'>{k}: "
                     f"{ {'F': 'forward', 'B': 'backward', 'W': 'weight gradient'}[k]}</span>"
                     for k, c in _KIND_COLOUR.items() if k != "W" or plan.schedule == "zb-h1")
    ms = lambda t: f"{t * 1e3:.3f} ms" if t < 1 else f"{t:.3f} s"      # noqa: E731
    head = (f"<h1>pipeline plan for {_esc(plan.inner.graph.info.name)} on mesh "
            f"{_esc(plan.mesh)}: {p} stages, {_esc(plan.schedule)}, {m} micro-batches"
            + (f", {v} chunks per device" if v > 1 else "") + "</h1>"
            f"<p>estimated step <span class=num id=step>{ms(plan.estimated_step_time_s)}"
            f"</span> (bubble {ms(plan.bubble_s)}, p2p {ms(plan.p2p_s)}, once a step "
            f"{ms(plan.update_s)}); peak memory per device <span class=num id=peak>"
            f"{format_bytes(int(plan.peak_memory_bytes))}</span> of "
            f"{format_bytes(plan.memory_limit_bytes)}: "
            f"{'fits' if plan.fits else 'DOES NOT FIT'}</p>")
    sched = (f"<h2>schedule</h2><p>one row per stage, time left to right (simulated, "
             f"transfers aside): idle {idle:.1%} of device time</p><div class=legend>{legend}"
             f"</div><svg id=schedule width='{width + 80:.0f}' height='{p * row}' "
             f"font-size='11'>{''.join(rects)}</svg>")
    stage_rows = "".join(
        f"<tr><td>{d}</td><td>{_esc(', '.join(s.units))}</td><td>{ms(s.fwd_s)}</td>"
        f"<td>{ms(s.bwd_s)}</td><td>{s.in_flight:g}</td>"
        f"<td>{_esc(format_bytes(int(s.peak_bytes)))}</td></tr>"
        for d, s in enumerate(plan.stages))
    stages = ("<h2>stages</h2><table><tr><th>stage</th><th>units</th><th>forward per "
              "micro-batch</th><th>backward</th><th>micro-batches in flight</th><th>peak</th>"
              f"</tr>{stage_rows}</table>")
    chosen = (plan.inner.strategy, plan.schedule, m, v, plan.keep_params)
    mark = lambda t: "*" if (t.inner, t.schedule, t.microbatches, t.virtual_stages,  # noqa: E731
                             t.keep_params) == chosen else ""
    tried_rows = "".join(
        f"<tr><td>{mark(t)}</td><td>{_esc(t.schedule)}</td>"
        f"<td>{t.microbatches}</td><td>{t.virtual_stages}</td>"
        f"<td>{'kept' if t.keep_params else 'again per micro-batch'}</td>"
        f"<td>{ms(t.step_time_s)}</td><td>{ms(t.bubble_s)}</td>"
        f"<td>{_esc(format_bytes(int(t.peak_memory_bytes)))}</td>"
        f"<td>{'yes' if t.fits else 'no'}</td></tr>" for t in plan.tried[:12])
    tried = ("<h2>tried (fastest first; * the plan)</h2><table><tr><th></th><th>schedule</th>"
             "<th>micro-batches</th><th>chunks per device</th><th>parameters gathered</th>"
             "<th>step</th><th>bubble</th><th>peak</th><th>fits</th></tr>"
             f"{tried_rows}</table>") if plan.tried else ""
    inner = plan.inner
    rep = plan_report(inner)
    layouts = (f"<h2>every stage's layouts</h2><p>the {_esc(inner.strategy)} plan on "
               f"{_esc(inner.mesh)}: each stage's ranks run its units' ops in these layouts"
               "</p>")
    body = [head, sched, stages, tried, layouts, _html_graph(inner, rep), _html_memory(rep),
            _html_timeline(inner, rep), _html_collectives(rep)]
    return ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>meshplan pipeline "
            f"plan</title><style>{_CSS}</style></head><body>" + "".join(body)
            + "</body></html>\n")


__all__ = ["diff_pipeline", "explain_pipeline", "explain_pipeline_text",
           "render_pipeline_html"]
