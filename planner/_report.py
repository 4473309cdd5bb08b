"""Plans people can read, explain and compare: the ``meshplan plan show|explain|diff`` data.

``plan_report(plan)`` is the stable ``--json`` schema of ``meshplan plan show`` (format
``"meshplan.plan-report"``, version 1). Keys (times in seconds, sizes in bytes per rank, layouts
as strings like ``"(S(0), R)"``, one placement per mesh axis; ``"-"`` for a non-tensor value):

* ``format``, ``version``; ``graph``: the traced step's name;
* ``mesh``: ``{"axes": [[name, size], ...], "sizes", "names", "world_size", "topology"}``
  (``topology`` is the topology's name); ``topology``: the full topology dict;
* ``strategy``; ``graph_hash`` (sha256 of the planned graph), ``torch_version``,
  ``meshplan_version`` (what compiled it; null in plans saved before these were recorded);
  ``estimated_step_time_s`` = ``compute_time_s`` + ``comm_time_s``;
  ``peak_memory_bytes``, ``memory_limit_bytes``, ``fits``;
* ``fully_replicated``: true when the mesh has several ranks and every state and data input is
  Replicate on every axis (each rank runs the whole batch: no parallelism);
  ``sharded_alternatives``: for such an ``auto`` plan, the hand-written families planned for
  comparison, ``{"plans": [{"strategy", "estimated_step_time_s", "compute_time_s",
  "comm_time_s", "peak_memory_bytes", "fits"}, ...] (fastest first), "skipped": [[family,
  why], ...]}``; null when not compared (not fully replicated, made with input pins, or saved
  before comparisons were recorded);
* ``memory``: per rank at the peak: ``parameters_bytes``, ``gradients_bytes`` (persistent
  ``.grad`` inputs; gradients made inside the step count as activations),
  ``optimizer_state_bytes``, ``buffers_bytes``, ``activations_bytes`` (peak minus state),
  ``peak_bytes``, ``limit_bytes``, ``symmetric`` (true: every rank of these plans holds the
  same amounts; state bytes = nbytes / shards of its layout);
* ``nodes``: per placed node in graph order: ``name``, ``target``, ``kind``, ``phase``,
  ``module``, ``source`` (``file:line`` or null), ``inputs``/``outputs`` (layouts), ``compute_s``;
* ``layers``: nodes grouped by module path with layer indices collapsed (``model.h.#.attn``;
  ``"<step>"`` for code outside modules): ``layer``, ``nodes``, ``compute_s``, ``params``
  (``{param name: [layouts]}``, the name relative to the layer);
* ``collectives``: every redistribution: ``value``, ``consumer``, ``src``, ``dst``, ``steps``
  (``[[kind, axis, bytes], ...]``), ``count``, ``time_s``; ``collective_totals``: per
  ``[kind, axis]``: ``count``, ``bytes``, ``time_s``;
* ``bucket_bytes``: the gradient bucket cap the cost model chose (``planner/_comm.py``:
  ``best_bucket_bytes``; null: nothing to bucket, or a plan saved before it was chosen);
* ``fallbacks``: op targets without a sharding rule (run replicated); ``solver``: its stats
  (``*_s`` fields are wall times and vary between runs);
* ``recompute``: null, or the activation recompute the plan runs: ``policy``, ``layers``,
  ``recompute_s`` (estimated seconds of recomputed forward per step) and ``freed_bytes``
  (activation bytes per device no longer held when the backward starts);
* ``random_ops``: the nodes that draw random numbers (dropout's ``bernoulli``...; on a mesh they
  do not match one process bit for bit, ``backends/_rng.py``): ``name``, ``target``,
  ``source``, ``outputs`` (layouts: each rank draws its own values on the axes that shard
  them, the same values on the others);
* ``kernels`` (added by ``meshplan plan show``, which lowers: the planner prices the kernels
  it expects, ``_kernel_cost.py``, and the lowering decides): ``{"device", "rank", "enabled",
  "kernels": [{"kernel", "backend", "calls", "updates", "replaced_nodes", "doc"}]}``, what
  rank 0's program uses on the plan's device (the topology's ``device``), see
  ``backends/_kernels.py``.
"""

from __future__ import annotations

import difflib
import re
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from .._errors import PlanError
from ..ir import NodeKind, Ref, Role, TensorMeta, random_nodes
from ._placement import Layout, layout_fraction
from ._plan import layout_str

if TYPE_CHECKING:
    from ._plan import Plan

REPORT_FORMAT = "meshplan.plan-report"
REPORT_VERSION = 1
_ROLE_KEYS = {Role.PARAM: "parameters_bytes", Role.GRAD: "gradients_bytes",
              Role.OPT_STATE: "optimizer_state_bytes", Role.BUFFER: "buffers_bytes"}


def plan_report(plan: Plan) -> dict[str, Any]:
    """The documented, JSON-ready report of ``plan`` (see the module docstring)."""
    mesh = plan.mesh
    return {
        "format": REPORT_FORMAT, "version": REPORT_VERSION,
        "graph": plan.graph.info.name,
        "mesh": {"axes": [[a, n] for a, n in mesh.axes], "names": list(mesh.names),
                 "sizes": list(mesh.sizes), "world_size": _world(plan),
                 "topology": mesh.topology.name},
        "topology": mesh.topology.to_dict(),
        "strategy": plan.strategy,
        "graph_hash": plan.graph_hash,
        "torch_version": plan.torch_version,
        "meshplan_version": plan.meshplan_version,
        "estimated_step_time_s": plan.estimated_step_time_s,
        "compute_time_s": plan.compute_time_s,
        "comm_time_s": plan.comm_time_s,
        "peak_memory_bytes": plan.peak_memory_bytes,
        "memory_limit_bytes": plan.memory_limit_bytes,
        "fits": plan.fits,
        "fully_replicated": plan.fully_replicated,
        "sharded_alternatives": (None if plan.sharded_alternatives is None
                                 else plan.sharded_alternatives.to_dict()),
        "memory": memory_breakdown(plan),
        "nodes": _nodes(plan),
        "layers": _layers(plan),
        "collectives": [_collective(r) for r in plan.redistributions],
        "collective_totals": _totals(plan),
        "bucket_bytes": plan.bucket_bytes,
        "fallbacks": list(plan.fallbacks),
        "random_ops": _random_ops(plan),
        "solver": dict(plan.solver),
        "recompute": _recompute(plan),
    }


def _recompute(plan: Plan) -> dict[str, Any] | None:
    from ._planning import recompute_cost

    if plan.recompute is None:
        return None
    seconds, freed = recompute_cost(plan)
    return {"policy": plan.recompute[0], "layers": list(plan.recompute[1]),
            "recompute_s": seconds, "freed_bytes": freed}


def _random_ops(plan: Plan) -> list[dict[str, Any]]:
    placed = {p.node: p for p in plan.placements}
    return [{"name": n.name, "target": n.target,
             "source": f"{n.source.file}:{n.source.line}" if n.source else None,
             "outputs": [layout_str(l) for l in placed[n.name].outputs]}
            for n in random_nodes(plan.graph) if n.name in placed]


def _world(plan: Plan) -> int:
    n = 1
    for s in plan.mesh.sizes:
        n *= s
    return n


def memory_breakdown(plan: Plan) -> dict[str, Any]:
    """Bytes per rank by role at the peak; every rank of a plan holds the same amounts."""
    out: dict[str, Any] = {k: 0 for k in _ROLE_KEYS.values()}
    placed = {p.node: p for p in plan.placements}
    for n in plan.graph.inputs:
        key = _ROLE_KEYS.get(n.meta.role)
        p = placed.get(n.name)
        if key is None or p is None or p.outputs[0] is None:
            continue
        out[key] += int(n.meta.nbytes // layout_fraction(p.outputs[0], plan.mesh.sizes))
    state = sum(out.values())
    out["activations_bytes"] = max(0, plan.peak_memory_bytes - state)
    out["peak_bytes"] = plan.peak_memory_bytes
    out["limit_bytes"] = plan.memory_limit_bytes
    out["symmetric"] = True
    return out


def _nodes(plan: Plan) -> list[dict[str, Any]]:
    out = []
    for p in plan.placements:
        n = plan.graph.node(p.node)
        out.append({
            "name": p.node, "target": p.target, "kind": n.kind.value, "phase": n.phase.value,
            "module": n.module_path,
            "source": f"{n.source.file}:{n.source.line}" if n.source else None,
            "inputs": [layout_str(l) for l in p.inputs],
            "outputs": [layout_str(l) for l in p.outputs],
            "compute_s": p.compute_s,
        })
    return out


def layer_key(module_path: str) -> str:
    """``model.h.3.attn`` -> ``model.h.#.attn``; ``""`` -> ``"<step>"``."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "#", module_path) if module_path else "<step>"


def _layers(plan: Plan) -> list[dict[str, Any]]:
    layers: dict[str, dict[str, Any]] = {}

    def layer(key: str) -> dict[str, Any]:
        return layers.setdefault(key, {"layer": key, "nodes": 0, "compute_s": 0.0, "params": {}})

    placed = {p.node: p for p in plan.placements}
    for p in plan.placements:
        n = plan.graph.node(p.node)
        if n.kind is NodeKind.INPUT:
            continue
        entry = layer(layer_key(n.module_path))
        entry["nodes"] += 1
        entry["compute_s"] += p.compute_s
    for n in plan.graph.inputs_with_role(Role.PARAM):
        if n.name not in placed:
            continue
        module, _, leaf = n.target.rpartition(".")
        key = layer_key(module)
        seen = layer(key)["params"].setdefault(leaf if module else n.target, [])
        lay = layout_str(placed[n.name].outputs[0])
        if lay not in seen:
            seen.append(lay)
    return list(layers.values())


def _collective(r: Any) -> dict[str, Any]:
    return {"value": r.value, "consumer": r.consumer, "src": layout_str(r.src),
            "dst": layout_str(r.dst), "steps": [list(c) for c in r.collectives],
            "count": r.count, "time_s": r.time_s}


def _totals(plan: Plan) -> list[dict[str, Any]]:
    agg: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for r in plan.redistributions:
        for k, (kind, axis, nbytes) in enumerate(r.collectives):
            a = agg[(kind, axis)]
            a[0] += r.count
            a[1] += nbytes * r.count
            if k == 0:
                a[2] += r.time_s * r.count
    return [{"kind": k, "axis": ax, "count": int(c), "bytes": int(b), "time_s": t}
            for (k, ax), (c, b, t) in sorted(agg.items(), key=lambda kv: -kv[1][2])]


# ---- explain ----------------------------------------------------------------------------------

def explain(plan: Plan, node: str) -> dict[str, Any]:
    """Why ``node`` runs as it does: its chosen choice and every alternative with its cost split.

    Alternatives come from the problem rebuilt from the plan's graph without pins, and each is
    priced holding every other node at its chosen layout: a local view, not the ILP's global
    trade-off (a choice that looks cheaper here may force costlier changes elsewhere, or break
    the memory limit, when its neighbours move too). Impossible layout changes cost ``None``.
    """
    from ._planning import _prepare
    from ._problem import build_problem

    graph = plan.graph
    if node not in graph or node not in {p.node for p in plan.placements}:
        names = [p.node for p in plan.placements] + [n.target for n in graph.nodes]
        close = difflib.get_close_matches(node, names, n=5, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise PlanError(f"plan has no placed node {node!r}{hint} (list nodes with "
                        "`meshplan plan show PLAN --json`)")
    problem = build_problem(_prepare(graph), plan.mesh)
    dec = problem.decisions.get(node)
    mine = plan.placement(node)
    choices = list(dec.choices) if dec else []
    chosen_ix = next((i for i, c in enumerate(choices)
                      if c.inputs == mine.inputs and c.outputs == mine.outputs), None)
    rows = [_price(plan, node, c.inputs, c.outputs, c.compute_s, c.comm_s) for c in choices]
    if chosen_ix is None:      # a hand strategy's read restriction may reshape it: add it as is
        rows.append(_price(plan, node, mine.inputs, mine.outputs, mine.compute_s, 0.0))
        chosen_ix = len(rows) - 1
    rows[chosen_ix]["chosen"] = True
    rows.sort(key=lambda r: (r["total_s"] is None, r["total_s"] or 0.0, not r["chosen"]))
    n = graph.node(node)
    return {"node": node, "target": n.target, "phase": n.phase.value, "module": n.module_path,
            "recompute": _recompute_role(plan, node),
            "source": f"{n.source.file}:{n.source.line}" if n.source else None,
            "chosen": next(r for r in rows if r["chosen"]),
            "alternatives": rows, "why": _why(rows),
            "note": "alternatives priced holding every other node at its chosen layout"}


def _recompute_role(plan: Plan, node: str) -> str | None:
    """What activation recompute does with ``node``: None when nothing."""
    from ..ir._recompute import PREFIX

    if plan.recompute is None:
        return None
    graph = plan.graph
    if node.startswith(PREFIX) and node[len(PREFIX):] in graph:
        return (f"recomputed: this is {node[len(PREFIX):]} computed again for the backward "
                f"({plan.recompute[0]} recompute of {graph.node(node).module_path})")
    if PREFIX + node in graph:
        return (f"recomputed in the backward as {PREFIX + node}; this value is freed after its "
                "last forward use")
    return None


def _price(plan: Plan, node: str, inputs: tuple, outputs: tuple, compute_s: float,
           folded_s: float) -> dict[str, Any]:
    from ._problem import reshard_steps

    graph, mesh = plan.graph, plan.mesh
    placed = {p.node: p for p in plan.placements}
    n = graph.node(node)
    edges: list[dict[str, Any]] = []

    def edge(direction: str, ref: Ref, other: str, src: Layout | None,
             dst: Layout | None) -> None:
        meta = graph.meta(ref)
        if not isinstance(meta, TensorMeta) or src is None or dst is None or src == dst:
            return
        steps = reshard_steps(meta, src, dst, mesh)
        edges.append({"direction": direction, "value": ref.label, "other": other,
                      "src": layout_str(src), "dst": layout_str(dst),
                      "steps": None if steps is None else
                      [[k.value, mesh.names[a], int(b)] for k, a, b, _ in steps],
                      "time_s": None if steps is None else float(sum(s[3] for s in steps))})

    for pos, r in enumerate(n.refs()):
        if r.node in placed and pos < len(inputs):
            edge("in", r, r.node, placed[r.node].outputs[r.index], inputs[pos])
    for user in graph.users.get(node, ()):
        if user not in placed:
            continue
        for pos, r in enumerate(graph.node(user).refs()):
            if r.node == node and r.index < len(outputs):
                edge("out", r, user, outputs[r.index], placed[user].inputs[pos])
    _state_edges(plan, node, outputs, placed, edge)
    in_s = [e["time_s"] for e in edges if e["direction"] == "in"]
    out_s = [e["time_s"] for e in edges if e["direction"] == "out"]
    mem = sum(m.nbytes // layout_fraction(l, mesh.sizes) for m, l in zip(n.outputs, outputs)
              if isinstance(m, TensorMeta) and l is not None)
    total = None if None in in_s + out_s else compute_s + folded_s + sum(in_s) + sum(out_s)
    return {"inputs": [layout_str(l) for l in inputs],
            "outputs": [layout_str(l) for l in outputs], "chosen": False,
            "compute_s": compute_s, "folded_comm_s": folded_s,
            "input_reshard_s": None if None in in_s else float(sum(in_s)),
            "output_reshard_s": None if None in out_s else float(sum(out_s)),
            "total_s": total, "output_bytes_per_rank": int(mem), "reshards": edges}


def _state_edges(plan: Plan, node: str, outputs: tuple, placed: dict, edge: Any) -> None:
    from ..ir import OutputKind
    from ._placement import R

    inputs = {n.target: n.name for n in plan.graph.inputs}
    for o in plan.graph.outputs:
        if o.ref.node != node or o.ref.index >= len(outputs):
            continue
        if o.kind is OutputKind.STATE and inputs.get(o.name) in placed and inputs[o.name] != node:
            edge("out", o.ref, f"<state {o.name}>", outputs[o.ref.index],
                 placed[inputs[o.name]].outputs[0])
        elif o.kind is OutputKind.RESULT:
            edge("out", o.ref, "<result>", outputs[o.ref.index],
                 tuple(R for _ in plan.mesh.sizes))


def _why(rows: list[dict[str, Any]]) -> str:
    chosen = next(r for r in rows if r["chosen"])
    others = [r for r in rows if not r["chosen"]]
    name = ", ".join(chosen["outputs"]) or "-"
    if not others:
        return f"chosen {name}: the only layout this node can take here"
    nxt = others[0]
    alt = ", ".join(nxt["outputs"])
    if nxt["total_s"] is None:
        return f"chosen {name}: every alternative needs an impossible layout change"
    cause = _cause(nxt)
    if chosen["total_s"] is not None and chosen["total_s"] <= nxt["total_s"]:
        gap = (nxt["total_s"] - chosen["total_s"]) * 1e3
        return f"chosen {name}: {gap:.4f} ms cheaper than the next {alt}{cause}"
    gap = (chosen["total_s"] - nxt["total_s"]) * 1e3 if chosen["total_s"] is not None else 0
    return (f"chosen {name}: locally {gap:.4f} ms dearer than {alt}{cause}, so the solver "
            "took it for a global reason (neighbours' layouts, shared layer decisions, the "
            "memory limit, or the strategy's pins)")


def _cause(row: dict[str, Any]) -> str:
    worst = max((e for e in row["reshards"] if e["time_s"]), key=lambda e: e["time_s"],
                default=None)
    if worst is None or not worst["steps"]:
        return ""
    kind, axis, _ = worst["steps"][0]
    return f" which needs {kind.replace('_', '-')} of {worst['value']} on {axis}"


# ---- diff -------------------------------------------------------------------------------------

def diff(a: Plan, b: Plan) -> dict[str, Any]:
    """What changed from plan ``a`` to plan ``b``: placements, collectives, time, memory."""
    pa = {p.node: p for p in a.placements}
    pb = {p.node: p for p in b.placements}
    changed = []
    for name, p in pa.items():
        q = pb.get(name)
        if q is not None and (p.inputs, p.outputs) != (q.inputs, q.outputs):
            changed.append({"node": name, "target": p.target,
                            "before": [layout_str(l) for l in p.outputs],
                            "after": [layout_str(l) for l in q.outputs],
                            "inputs_before": [layout_str(l) for l in p.inputs],
                            "inputs_after": [layout_str(l) for l in q.inputs]})
    ca = [_collective(r) for r in a.redistributions]
    cb = [_collective(r) for r in b.redistributions]
    key = lambda c: repr({k: v for k, v in c.items() if k != "time_s"})
    kb, ka = {key(c) for c in cb}, {key(c) for c in ca}
    out: dict[str, Any] = {
        "mesh": _change(str(a.mesh), str(b.mesh)),
        "strategy": _change(a.strategy, b.strategy),
        "placements": changed,
        "nodes_only_in_a": sorted(set(pa) - set(pb)),
        "nodes_only_in_b": sorted(set(pb) - set(pa)),
        "collectives_only_in_a": [c for c in ca if key(c) not in kb],
        "collectives_only_in_b": [c for c in cb if key(c) not in ka],
        "estimated_step_time_s": _delta(a.estimated_step_time_s, b.estimated_step_time_s),
        "compute_time_s": _delta(a.compute_time_s, b.compute_time_s),
        "comm_time_s": _delta(a.comm_time_s, b.comm_time_s),
        "peak_memory_bytes": _delta(a.peak_memory_bytes, b.peak_memory_bytes),
        "bucket_bytes": _change(str(a.bucket_bytes), str(b.bucket_bytes)),
        "placements_by_part": _changes_by_part(a, pa, changed),
        "collective_totals": _totals_change(a, b),
    }
    out["identical"] = not (out["mesh"] or out["strategy"] or changed or out["nodes_only_in_a"]
                            or out["bucket_bytes"]
                            or out["nodes_only_in_b"] or out["collectives_only_in_a"]
                            or out["collectives_only_in_b"]
                            or out["estimated_step_time_s"]["delta"]
                            or out["peak_memory_bytes"]["delta"])
    return out


def _part(graph: Any, name: str) -> str:
    node = graph.node(name)
    if node.kind is NodeKind.INPUT:
        return f"{node.meta.role.value} inputs"
    return f"{node.phase.value} ops" if node.kind is NodeKind.OP else f"{node.kind.value}s"


def _changes_by_part(a: Plan, placed: dict[str, Any],
                     changed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The changed placements counted per part of the step (inputs by role, ops by phase),
    with the most common changes of output layout: what ``plan diff`` says before listing."""
    total: dict[str, int] = defaultdict(int)
    for name in placed:
        total[_part(a.graph, name)] += 1
    kinds: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for c in changed:
        what = (f"{', '.join(c['before'])} -> {', '.join(c['after'])}"
                if c["before"] != c["after"] else "reads its inputs differently")
        kinds[_part(a.graph, c["node"])][what] += 1
    return [{"part": part, "changed": sum(k.values()), "of": total[part],
             "changes": sorted(([w, n] for w, n in k.items()), key=lambda wn: -wn[1])}
            for part, k in sorted(kinds.items(), key=lambda kv: -sum(kv[1].values()))]


def _totals_change(a: Plan, b: Plan) -> list[dict[str, Any]]:
    """Collectives per step by kind and mesh axis in ``a`` and in ``b``."""
    ta = {(t["kind"], t["axis"]): t for t in _totals(a)}
    tb = {(t["kind"], t["axis"]): t for t in _totals(b)}
    zero = {"count": 0, "bytes": 0, "time_s": 0.0}
    out = []
    for key in sorted(set(ta) | set(tb)):
        x, y = ta.get(key, zero), tb.get(key, zero)
        out.append({"kind": key[0], "axis": key[1], "count_a": x["count"], "count_b": y["count"],
                    "bytes_a": x["bytes"], "bytes_b": y["bytes"], "time_a_s": x["time_s"],
                    "time_b_s": y["time_s"]})
    return out


def _change(x: str, y: str) -> dict[str, str] | None:
    return None if x == y else {"before": x, "after": y}


def _delta(x: float, y: float) -> dict[str, float]:
    return {"a": x, "b": y, "delta": y - x}


# ---- html -------------------------------------------------------------------------------------

_CSS = """body{font:13px system-ui,sans-serif;margin:16px;color:#222}h1{font-size:18px}
h2{font-size:15px;margin-top:20px}.num{font-weight:600}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}.strip{display:flex;flex-wrap:wrap;
gap:2px}.cell{min-width:10px;height:22px;border-radius:2px;font-size:10px;color:#fff;padding:0 2px;
box-sizing:border-box;overflow:hidden;white-space:nowrap}.coll{outline:3px solid #d00}
.legend span{display:inline-block;padding:1px 6px;margin:2px;color:#fff;border-radius:2px}"""
_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#e15759", "#76b7b2", "#edc948",
            "#9c755f", "#ff9da7", "#bab0ac")
_MAX_CELLS = 400


def _esc(s: object) -> str:
    import html

    return html.escape(str(s), quote=True)


def render_html(plan: Plan) -> str:
    """ONE self-contained offline page: the step's nodes coloured by output layout (grouped by
    layer when the graph is large) with collectives marked, memory bars per rank, and the
    estimated step timeline. Inline CSS and SVG only; no scripts, no external references."""
    from ._summary import format_bytes, replication_lines

    rep = plan_report(plan)
    ms = lambda s: f"{s * 1e3:.3f} ms"
    # the same count as the collectives table: each collective of each layout change, per step
    ncoll = sum(t["count"] for t in rep["collective_totals"])
    replicated = "".join(f"<p class=replicated>{_esc(line)}</p>"
                         for line in replication_lines(rep))
    head = (f"<h1>plan [{_esc(plan.strategy)}] for {_esc(rep['graph'])} on mesh "
            f"{_esc(plan.mesh)}</h1><p>estimated step time <span class=num id=step>"
            f"{ms(plan.estimated_step_time_s)}</span> (compute {ms(plan.compute_time_s)}, "
            f"communication {ms(plan.comm_time_s)}); peak memory per rank <span class=num "
            f"id=peak>{format_bytes(plan.peak_memory_bytes)}</span> of "
            f"{format_bytes(plan.memory_limit_bytes)}: {'fits' if plan.fits else 'DOES NOT FIT'}"
            f"; <span id=collectives>{ncoll}</span> collectives per step; "
            f"{rep['mesh']['world_size']} ranks (every rank holds the same amounts)</p>"
            + replicated)
    body = [head, _html_graph(plan, rep), _html_memory(rep), _html_timeline(plan, rep),
            _html_collectives(rep)]
    return ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>meshplan plan "
            f"{_esc(plan.strategy)}</title><style>{_CSS}</style></head><body>"
            + "".join(body) + "</body></html>\n")


def _html_graph(plan: Plan, rep: dict[str, Any]) -> str:
    colours: dict[str, str] = {}

    def colour(lay: str) -> str:
        return colours.setdefault(lay, _PALETTE[len(colours) % len(_PALETTE)])

    moved = {r.value.split("[")[0] for r in plan.redistributions}
    nodes = [n for n in rep["nodes"] if n["kind"] != "input"]
    cells = []
    if len(nodes) <= _MAX_CELLS:
        for n in nodes:
            lay = n["outputs"][0] if n["outputs"] else "-"
            cls = "cell coll" if n["name"] in moved else "cell"
            cells.append(f"<div class='{cls}' style='background:{colour(lay)}' title='"
                         f"{_esc(n['name'])} {_esc(n['target'])} {_esc(n['module'])} "
                         f"{_esc(n['phase'])} out {_esc(lay)}'>&nbsp;</div>")
        title = "nodes in order, coloured by output layout (red outline: its value is resharded)"
    else:
        for layer in rep["layers"]:
            lays = [v for vs in layer["params"].values() for v in vs] or ["-"]
            cells.append(f"<div class=cell style='background:{colour(lays[0])};width:auto' "
                         f"title='{_esc(', '.join(lays))}'>{_esc(layer['layer'])} "
                         f"({layer['nodes']})</div>")
        title = "layers, coloured by their first parameter's layout"
    legend = "".join(f"<span style='background:{c}'>{_esc(l)}</span>" for l, c in colours.items())
    return (f"<h2>graph</h2><p>{title}; layouts per mesh axis ({_esc(', '.join(plan.mesh.names))})"
            f"</p><div class=legend>{legend}</div><div class=strip>{''.join(cells)}</div>")


def _html_memory(rep: dict[str, Any]) -> str:
    from ._summary import format_bytes

    m = rep["memory"]
    parts = [("parameters", m["parameters_bytes"], "#4e79a7"),
             ("gradients", m["gradients_bytes"], "#f28e2b"),
             ("optimizer", m["optimizer_state_bytes"], "#59a14f"),
             ("buffers", m["buffers_bytes"], "#bab0ac"),
             ("activations", m["activations_bytes"], "#e15759")]
    scale = max(m["peak_bytes"], 1)
    rows = []
    for rank in range(rep["mesh"]["world_size"]):
        x, rects = 80.0, []
        for name, b, col in parts:
            w = 500.0 * b / scale
            rects.append(f"<rect x='{x:.1f}' y='{rank * 22}' width='{w:.1f}' height='18' "
                         f"fill='{col}'><title>{name} {_esc(format_bytes(b))}</title></rect>")
            x += w
        rows.append(f"<text x='0' y='{rank * 22 + 13}'>rank {rank}</text>" + "".join(rects))
    h = 22 * rep["mesh"]["world_size"]
    legend = "".join(f"<span style='background:{c}'>{n} {_esc(format_bytes(b))}</span>"
                     for n, b, c in parts)
    frac = m["peak_bytes"] / max(m["limit_bytes"], 1)
    return (f"<h2>memory per rank</h2><p>peak {_esc(format_bytes(m['peak_bytes']))} = "
            f"{frac:.2%} of the {_esc(format_bytes(m['limit_bytes']))} limit (bars are scaled "
            f"to the peak)</p><div class=legend>{legend}</div><svg width='600' height='{h}' "
            f"font-size='11'>{''.join(rows)}</svg>")


def _html_timeline(plan: Plan, rep: dict[str, Any]) -> str:
    total = max(plan.estimated_step_time_s, 1e-15)
    comm_of: dict[str, float] = defaultdict(float)
    for r in plan.redistributions:
        comm_of[r.consumer] += r.time_s
    x, rects = 0.0, []
    for n in rep["nodes"]:
        for t, y, col, what in ((comm_of.get(n["name"], 0.0), 22, "#e15759", "comm before"),
                                (n["compute_s"], 0, "#4e79a7", "compute")):
            if t <= 0:
                continue
            w = 800.0 * t / total
            rects.append(f"<rect x='{x:.2f}' y='{y}' width='{max(w, 0.5):.2f}' height='18' "
                         f"fill='{col}'><title>{_esc(n['name'])} {what} {t * 1e6:.2f} us"
                         "</title></rect>")
            x += w
    return ("<h2>estimated step timeline</h2><p>compute (top, blue) and communication (bottom, "
            f"red) in sequence: compute {plan.compute_time_s * 1e3:.3f} ms, communication "
            f"{plan.comm_time_s * 1e3:.3f} ms</p><svg width='820' height='44'>"
            f"{''.join(rects)}</svg>")


def _html_collectives(rep: dict[str, Any]) -> str:
    from ._summary import format_bytes

    rows = "".join(f"<tr><td>{_esc(t['kind'])}</td><td>{_esc(t['axis'])}</td><td>{t['count']}"
                   f"</td><td>{_esc(format_bytes(t['bytes']))}</td><td>{t['time_s'] * 1e3:.4f} "
                   "ms</td></tr>" for t in rep["collective_totals"])
    return ("<h2>collectives per step</h2><table><tr><th>collective</th><th>axis</th>"
            f"<th>count</th><th>bytes</th><th>time</th></tr>{rows}</table>")
