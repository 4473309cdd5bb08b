"""``plan_graph``: from a traced graph and a mesh to a Plan."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence

from .._errors import PlanError
from ..ir import Graph, Ref, split_foreach
from ._comm import Collective, best_bucket_bytes
from ._hand import FAMILY_COLLECTIVES, HAND_STRATEGIES, hand_pins, hand_reads, hand_update_reads
from ._mesh import Mesh, Topology
from ._placement import Layout, R, format_layout, parse_placement
from ._plan import NodePlacement, Plan, PlanEstimate, Redistribution, ShardedAlternatives
from ._problem import STATE_POS, Problem, build_problem, reshard_steps, result_refs
from ._solve import Solution, min_peak_memory, solve
from ._summary import TIMED_OUT, format_bytes

logger = logging.getLogger(__name__)

Pins = Mapping[str, Layout | tuple[str, ...] | list[str] | str]

# the time the hand-written families' solves get together when a fully replicated automatic
# plan is compared with them (small models: each takes well under a second on one axis)
COMPARE_TIME_LIMIT_S = 10.0


def plan_graph(
    graph: Graph,
    mesh: Mesh | Mapping[str, int],
    *,
    topology: str | Topology | None = None,
    strategy: str = "auto",
    memory_limit_bytes: int | None = None,
    pins: Pins | None = None,
    time_limit_s: float = 60.0,
    compare_sharded: bool = False,
    axis_order: str = "auto",
) -> Plan:
    """Plan ``graph`` on ``mesh``.

    ``strategy="auto"`` searches all layouts under the memory limit (default: the topology's
    device memory). ``"dp"``, ``"fsdp"`` and ``"megatron_tp"`` fix the hand-written families'
    state and batch layouts and let the same solver place the rest, under the same cost model;
    their plans report ``fits`` rather than failing. ``pins`` fixes input layouts by state name,
    e.g. ``{"x": ("S(0)", "R")}`` shards the batch on the first mesh axis. ``time_limit_s``
    bounds the solver, all its memory rounds together (the plan it has then stands; ``fits``
    says whether it fits).

    With ``compare_sharded=True`` (``meshplan.compile``, ``meshplan compile``, the demo), when
    ``"auto"`` (without ``pins``) chooses a fully replicated plan, every rank running the whole
    batch, the hand-written families are planned too, within ``COMPARE_TIME_LIMIT_S``
    together, and the plan carries their estimates (``Plan.sharded_alternatives``) so that its
    summary can say what splitting the step would cost. ``distribute`` does not wait for
    that: its plan says it is fully replicated, and how to compare.

    Ranks are laid out row-major over the mesh's axes (the last is innermost: its groups are
    consecutive ranks, inside a node where they fit). With ``axis_order="auto"`` (default), on
    a mesh that spans nodes, the axes that move the most bytes go inside nodes: when the plan
    on the given order moves more over the fabric than the reordered mesh would, the
    reordered mesh is planned too and the faster plan is kept; its ``mesh`` then lists the
    axes in the new order (layouts and ranks follow it) and ``solver["axis_order"]`` says
    what moved and why. ``"given"`` keeps the order as written.
    """
    if axis_order not in ("auto", "given"):
        raise PlanError(f"axis_order must be 'auto' or 'given', got {axis_order!r}")
    if not isinstance(mesh, Mesh):
        mesh = Mesh(mesh, topology)
    elif topology is not None:
        mesh = Mesh(mesh.axes, topology)
    plan = _plan_on(graph, mesh, strategy, memory_limit_bytes, pins, time_limit_s,
                    compare_sharded)
    if axis_order == "given" or len(mesh.sizes) < 2 \
            or mesh.size <= mesh.topology.devices_per_node:
        return plan
    traffic = axis_traffic(plan)
    order = sorted(mesh.names, key=lambda a: (traffic.get(a, 0.0), mesh.names.index(a)))
    other = Mesh(tuple((a, mesh.sizes[mesh.index(a)]) for a in order), mesh.topology)
    given_bytes, other_bytes = _fabric_bytes(mesh, traffic), _fabric_bytes(other, traffic)
    if order == list(mesh.names) or other_bytes >= given_bytes:
        return plan
    alt = _plan_on(graph, other, strategy, memory_limit_bytes,
                   _permuted_pins(pins, mesh.names, other.names), time_limit_s, compare_sharded)
    best = alt if (alt.fits, -alt.estimated_step_time_s) > (plan.fits,
                                                              -plan.estimated_step_time_s) else plan
    note = (f"{'reordered' if best is alt else 'kept'}"
            f" {','.join(mesh.names)} -> {','.join(other.names)} was planned too "
            f"({alt.estimated_step_time_s * 1e3:.3f} ms vs {plan.estimated_step_time_s * 1e3:.3f}"
            f" ms as given): per step the given order moves {format_bytes(given_bytes)} between "
            f"nodes, the other {format_bytes(other_bytes)}")
    best.solver["axis_order"] = note
    logger.info("planning %s: axis order: %s", graph.info.name, note)
    return best


def axis_traffic(plan: Plan) -> dict[str, float]:
    """Bytes each mesh axis's collectives move per step in ``plan``."""
    out: dict[str, float] = {}
    for r in plan.redistributions:
        for _, axis, nbytes in r.collectives:
            out[axis] = out.get(axis, 0.0) + nbytes * r.count
    return out


def _fabric_bytes(mesh: Mesh, traffic: Mapping[str, float]) -> float:
    """Of ``traffic``, the bytes on axes whose groups span nodes on ``mesh``."""
    slow = mesh.topology.inter_node
    return sum(traffic.get(a, 0.0) for i, a in enumerate(mesh.names) if mesh.link(i) is slow
               and mesh.sizes[i] > 1)


def _permuted_pins(pins: Pins | None, given: Sequence[str], order: Sequence[str]) -> Pins | None:
    """User pins (placements in the given axis order) for the mesh reordered to ``order``."""
    if not pins:
        return pins
    out: dict[str, Layout | tuple[str, ...]] = {}
    for name, spec in pins.items():
        seq = tuple(spec.split(",")) if isinstance(spec, str) else tuple(spec)
        out[name] = (tuple(seq[list(given).index(a)] for a in order)
                     if len(seq) == len(given) else seq)      # a wrong length fails as usual
    return out


def _plan_on(graph: Graph, mesh: Mesh, strategy: str, memory_limit_bytes: int | None,
             pins: Pins | None, time_limit_s: float, compare_sharded: bool) -> Plan:
    """``plan_graph`` on one axis order."""
    t0 = time.perf_counter()
    graph = _prepare(graph)
    reads: dict[str, Layout] = {}
    update_reads: dict[str, Layout] = {}
    if strategy == "auto":
        fixed = _user_pins(graph, mesh, pins or {})
    elif strategy in HAND_STRATEGIES:
        fixed = hand_pins(graph, mesh, strategy)
        reads = hand_reads(graph, mesh, strategy, fixed)
        update_reads = hand_update_reads(graph, fixed)
        fixed.update(_user_pins(graph, mesh, pins or {}))
    else:
        raise PlanError(f"unknown strategy {strategy!r}; use 'auto' or one of {HAND_STRATEGIES}")
    limit = int(memory_limit_bytes if memory_limit_bytes is not None
                else mesh.topology.memory_bytes)
    if limit <= 0:
        raise PlanError(f"memory_limit_bytes must be positive, got {limit}")
    problem = build_problem(graph, mesh, fixed, reads, update_reads)
    problem.collectives = FAMILY_COLLECTIVES.get(strategy)
    t_problem = time.perf_counter() - t0
    if strategy == "auto":
        try:
            sol = solve(problem, limit, time_limit=time_limit_s)
        except PlanError as e:
            if "no plan fits" not in str(e):
                raise
            best = min_peak_memory(problem, time_limit=time_limit_s)
            raise PlanError(
                f"no plan of {graph.info.name} fits {format_bytes(limit)} per device on mesh "
                f"{mesh}: the best plan needs {format_bytes(best)} (misses by "
                f"{format_bytes(best - limit)}). Searched: every layout of the state, the "
                "batch and the activations over the mesh's axes (data, FSDP/ZeRO, tensor and "
                "sequence sharding); not searched yet: activation recompute, pipeline stages, "
                "offloading. Use a larger mesh, a smaller batch, lower-precision state, or "
                "raise memory_limit_bytes") from None
    else:
        sol = solve(problem, float("inf"), time_limit=time_limit_s)
    sol.solver["problem_s"] = t_problem
    sol.solver["plan_s"] = time.perf_counter() - t0
    plan = _make_plan(problem, sol, strategy, limit)
    if compare_sharded and strategy == "auto" and not pins and plan.fully_replicated:
        plan = dataclasses.replace(plan, sharded_alternatives=sharded_families(
            graph, mesh, limit, min(time_limit_s, COMPARE_TIME_LIMIT_S)))
    return plan


def sharded_families(graph: Graph, mesh: Mesh, memory_limit_bytes: int,
                    time_limit_s: float = COMPARE_TIME_LIMIT_S) -> ShardedAlternatives:
    """The hand-written families planned for ``graph`` on ``mesh`` (each as a plan that splits
    the work: one that comes out fully replicated is skipped). Their solves share
    ``time_limit_s``, each given at least the solver's minimum of 1 s, so every family is
    tried. Families without a plan here are listed in ``skipped`` with the reason (starting
    with ``TIMED_OUT`` when the solver ran out of time)."""
    deadline = time.perf_counter() + time_limit_s
    plans: list[PlanEstimate] = []
    skipped: list[tuple[str, str]] = []
    for family in HAND_STRATEGIES:
        try:
            plan = plan_graph(graph, mesh, strategy=family, memory_limit_bytes=memory_limit_bytes,
                              time_limit_s=max(1.0, deadline - time.perf_counter()))
        except PlanError as e:
            late = time.perf_counter() >= deadline
            skipped.append((family, f"{TIMED_OUT} ({e})" if late else str(e)))
            continue
        if plan.fully_replicated:
            skipped.append((family, "it splits nothing on this mesh (fully replicated too)"))
            continue
        plans.append(plan.estimate())
    plans.sort(key=lambda p: p.estimated_step_time_s)
    logger.info("fully replicated plan of %s on %s; sharded families: %s", graph.info.name, mesh,
                ", ".join(f"{p.strategy} {p.estimated_step_time_s * 1e3:.3f} ms" for p in plans)
                or "none")
    return ShardedAlternatives(tuple(plans), tuple(skipped))


def _prepare(graph: Graph) -> Graph:
    """Per-tensor ops instead of foreach ops: each parameter's update can be placed alone."""
    return split_foreach(graph)


def _user_pins(graph: Graph, mesh: Mesh, pins: Pins) -> dict[str, set[Layout]]:
    names = {n.target for n in graph.inputs}
    out: dict[str, set[Layout]] = {}
    for name, spec in pins.items():
        if name not in names:
            raise PlanError(f"pin names unknown input {name!r}; inputs are e.g. "
                            f"{sorted(names)[:6]}")
        if isinstance(spec, str):
            spec = tuple(spec.split(","))
        layout = tuple(parse_placement(p) if isinstance(p, str) else p for p in spec)
        if len(layout) != len(mesh.sizes):
            raise PlanError(f"pin for {name!r} gives {len(layout)} placements; mesh {mesh} has "
                            f"{len(mesh.sizes)} axes ({', '.join(mesh.names)})")
        out[name] = {layout}
    return out


def _make_plan(problem: Problem, sol: Solution, strategy: str, limit: int) -> Plan:
    graph, mesh, dec = problem.graph, problem.mesh, problem.decisions
    placements = []
    for node in graph.nodes:
        if node.name in dec:
            c = dec[node.name].choices[sol.choice[node.name]]
            placements.append(NodePlacement(node.name, node.target, c.inputs, c.outputs,
                                            c.compute_s))
    chosen = {p.node: p for p in placements}
    redistributions = []
    for e in problem.all_edges() + problem.folded:
        src = chosen[e.src].outputs[e.index]
        dst = chosen[e.dst].outputs[0] if e.pos == STATE_POS else chosen[e.dst].inputs[e.pos]
        if src != dst:
            consumer = f"<state {graph.node(e.dst).target}>" if e.pos == STATE_POS else e.dst
            redistributions.append(_redistribution(problem, Ref(e.src, e.index), consumer,
                                                   src, dst))
    rep = tuple(R for _ in mesh.sizes)
    for ref in result_refs(graph):
        if ref.node in chosen and chosen[ref.node].outputs[ref.index] != rep:
            redistributions.append(_redistribution(problem, ref, "<result>",
                                                   chosen[ref.node].outputs[ref.index], rep))
    comm = float(sum(r.time_s for r in redistributions))
    return Plan(
        mesh=mesh, strategy=strategy, graph=graph, placements=tuple(placements),
        redistributions=tuple(redistributions),
        estimated_step_time_s=sol.compute_s + comm, compute_time_s=sol.compute_s,
        comm_time_s=comm, peak_memory_bytes=sol.peak_memory_bytes, memory_limit_bytes=limit,
        fallbacks=tuple(problem.fallbacks), solver=dict(sol.solver),
        bucket_bytes=plan_bucket_bytes(mesh, redistributions),
    )


def plan_bucket_bytes(mesh: Mesh, redistributions: Sequence[Redistribution]) -> int | None:
    """The gradient bucket cap for the lowering: ``best_bucket_bytes`` for the mesh axis that
    all-reduces the most bytes in single all-reduces (the redistributions the lowering
    buckets: a partial sum made whole along one axis); None when there are none. A value
    with several consumers is listed once per consumer but reduced once (the lowering reuses
    the reduced copy), so it counts once."""
    per_axis: dict[str, float] = {}
    seen: set[tuple] = set()
    for r in redistributions:
        if len(r.collectives) == 1 and r.collectives[0][0] == Collective.ALL_REDUCE.value:
            if (r.value, r.src, r.dst) in seen:
                continue
            seen.add((r.value, r.src, r.dst))
            _, axis, nbytes = r.collectives[0]
            per_axis[axis] = per_axis.get(axis, 0.0) + nbytes * r.count
    if not per_axis:
        return None
    axis, total = max(per_axis.items(), key=lambda kv: (kv[1], kv[0]))
    a = mesh.names.index(axis)
    return best_bucket_bytes(total, mesh.sizes[a], mesh.link(a), mesh.topology.comm_overlap)


def _redistribution(problem: Problem, ref: Ref, consumer: str, src: Layout,
                    dst: Layout) -> Redistribution:
    meta = problem.graph.meta(ref)
    steps = reshard_steps(meta, src, dst, problem.mesh)
    if steps is None:
        raise PlanError(f"internal: impossible layout change {format_layout(src)} -> "
                        f"{format_layout(dst)} chosen for {ref}")
    return Redistribution(
        ref.label, consumer, src, dst,
        tuple((k.value, problem.mesh.names[axis], int(nbytes)) for k, axis, nbytes, _ in steps),
        float(sum(s[3] for s in steps)))
