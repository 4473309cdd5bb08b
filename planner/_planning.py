"""``plan_graph``: from a traced graph and a mesh to a Plan."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

from .._errors import PlanError
from ..ir import (
    RECOMPUTE_POLICIES, Graph, Phase, Ref, TensorMeta, hoist_casts, repeated_layers,
    split_foreach,
)
from ..ir._recompute import PREFIX as RECOMPUTE_PREFIX
from ..ir import recompute as recompute_graph
from ._comm import DEFAULT_BUCKET_BYTES, Collective, best_bucket_bytes, bucket_call_time
from ._hand import (FAMILIES, FAMILY_COLLECTIVES, HAND_STRATEGIES, hand_pins, hand_reads,
                    hand_update_reads)
from ._mesh import Mesh, Topology
from ._placement import Layout, R, format_layout, layout_fraction, parse_placement
from ._plan import NodePlacement, Plan, PlanEstimate, Redistribution, ShardedAlternatives
from ._problem import (
    STATE_POS, Problem, build_problem, is_follower, reshard_steps, result_refs,
)
from ._solve import Solution, min_peak_memory, peak_lower_bound, solve
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
    recompute: str | tuple[str, Sequence[str]] = "auto",
) -> Plan:
    """Plan ``graph`` on ``mesh``.

    ``strategy="auto"`` searches all layouts under the memory limit (default: the topology's
    device memory). ``"dp"``, ``"fsdp"``, ``"megatron_tp"`` and ``"megatron_zero"`` (Megatron's
    split with the optimizer state sharded over ``dp``: ``_hand.py``) fix the hand-written
    families' state and batch layouts and let the same solver place the rest, under the same
    cost model; their plans report ``fits`` rather than failing. ``pins`` fixes input layouts
    by state name, e.g. ``{"x": ("S(0)", "R")}`` shards the batch on the first mesh axis.
    ``time_limit_s`` bounds the solver, all its memory rounds together (the plan it has then
    stands; ``fits`` says whether it fits).

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

    ``recompute`` (activation recompute of the repeated layers, ``ir/_recompute.py``):
    ``"none"``, ``"selective"`` or ``"full"`` on every layer, ``(policy, layers)`` on those
    layers, or ``"auto"`` (default): recompute where no plan fits without it (see
    ``RECOMPUTE_TARGET``).
    """
    if axis_order not in ("auto", "given"):
        raise PlanError(f"axis_order must be 'auto' or 'given', got {axis_order!r}")
    check_recompute(recompute)
    from ._pipeline import refuse_pp

    refuse_pp(mesh, "plan_graph")
    with _planning_session():
        return _plan_axis_order(graph, mesh, topology, strategy, memory_limit_bytes, pins,
                                time_limit_s, compare_sharded, axis_order, recompute)


_session = threading.local()     # .memo while plan_graph runs: see _planning_session


@contextlib.contextmanager
def _planning_session():
    """What one ``plan_graph`` call (with the plans it makes inside: recompute policies,
    families, axis orders) shares:

    * the prepared graphs (``_prepared``), made once per traced graph and recompute choice
      instead of once per plan tried (half a second each on a 70B step);
    * fewer cyclic collections: planning makes millions of small tuples and dicts that live
      until the plan is made, and with the default threshold full collections scan that whole
      heap again and again (6 s of the 70B step's planning on 256 GPUs; 3 s with this). The
      threshold is restored after."""
    if getattr(_session, "memo", None) is not None:         # a plan_graph inside one
        yield
        return
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], 100_000), *old[1:])
    _session.memo = {}
    try:
        yield
    finally:
        _session.memo = None
        gc.set_threshold(*old)


def _plan_axis_order(graph: Graph, mesh: Mesh | Mapping[str, int], topology: str | Topology | None,
                     strategy: str, memory_limit_bytes: int | None, pins: Pins | None,
                     time_limit_s: float, compare_sharded: bool, axis_order: str,
                     recompute: str | tuple[str, Sequence[str]]) -> Plan:
    if not isinstance(mesh, Mesh):
        mesh = Mesh(mesh, topology)
    elif topology is not None:
        mesh = Mesh(mesh.axes, topology)
    plan = _plan_recompute(graph, mesh, strategy, memory_limit_bytes, pins, time_limit_s,
                           compare_sharded, recompute)
    if axis_order == "given" or len(mesh.sizes) < 2 \
            or mesh.size <= mesh.topology.devices_per_node:
        return plan
    traffic = axis_traffic(plan)
    order = sorted(mesh.names, key=lambda a: (traffic.get(a, 0.0), mesh.names.index(a)))
    other = Mesh(tuple((a, mesh.sizes[mesh.index(a)]) for a in order), mesh.topology)
    given_bytes, other_bytes = _fabric_bytes(mesh, traffic), _fabric_bytes(other, traffic)
    if order == list(mesh.names) or other_bytes >= given_bytes:
        return plan
    alt = _plan_recompute(graph, other, strategy, memory_limit_bytes,
                          _permuted_pins(pins, mesh.names, other.names), time_limit_s,
                          compare_sharded, recompute)
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


class _NoFit(PlanError):
    """No plan of the automatic search fits. ``problem()`` is what was searched: built when
    asked (for the error's smallest peak) where ``peak_lower_bound`` had already shown that
    no plan fits, so that nothing was searched."""

    def __init__(self, problem: Problem | Callable[[], Problem], limit: int,
                 time_limit_s: float, bound: int | None = None) -> None:
        super().__init__(f"no plan fits {format_bytes(limit)}")
        self._problem, self.limit, self.time_limit_s = problem, limit, time_limit_s
        self.bound = bound          # ``peak_lower_bound``'s, where it showed it

    def problem(self) -> Problem:
        if not isinstance(self._problem, Problem):
            self._problem = self._problem()
        return self._problem


def _plan_on(graph: Graph, mesh: Mesh, strategy: str, memory_limit_bytes: int | None,
             pins: Pins | None, time_limit_s: float, compare_sharded: bool,
             rc: tuple[str, tuple[str, ...]] | None = None, may_skip: bool = False) -> Plan:
    """``plan_graph`` on one axis order and one recompute choice (``_NoFit`` when the
    automatic search finds no plan under the limit; for a family, with ``may_skip``, when
    ``peak_lower_bound`` shows none of its plans can fit: the recompute search then tries
    the next policy without solving this one)."""
    t0 = time.perf_counter()
    traced = graph
    graph = _prepared(graph, rc)
    reads: dict[str, Layout] = {}
    update_reads: dict[str, Layout] = {}
    if strategy == "auto":
        fixed = _user_pins(graph, mesh, pins or {})
    elif strategy in FAMILIES:
        fixed = hand_pins(graph, mesh, strategy)
        reads = hand_reads(graph, mesh, strategy, fixed)
        update_reads = hand_update_reads(graph, fixed)
        fixed.update(_user_pins(graph, mesh, pins or {}))
    else:
        raise PlanError(f"unknown strategy {strategy!r}; use 'auto' or one of {FAMILIES}")
    limit = int(memory_limit_bytes if memory_limit_bytes is not None
                else mesh.topology.memory_bytes)
    if limit <= 0:
        raise PlanError(f"memory_limit_bytes must be positive, got {limit}")
    if strategy == "auto" or may_skip:
        bound = peak_lower_bound(graph, mesh, None if strategy == "auto" else fixed)
        if bound > limit:
            logger.info("planning %s%s: no plan can fit %s (at least %s per device)",
                        traced.info.name, f" with {rc[0]} recompute" if rc else "",
                        format_bytes(limit), format_bytes(bound))
            raise _NoFit(lambda: build_problem(graph, mesh, fixed), limit, time_limit_s,
                         bound)
    problem = build_problem(graph, mesh, fixed, reads, update_reads)
    problem.collectives = FAMILY_COLLECTIVES.get(strategy)
    t_problem = time.perf_counter() - t0
    if strategy == "auto":
        try:
            sol = solve(problem, limit, time_limit=time_limit_s)
        except PlanError as e:
            if "no plan fits" not in str(e):
                raise
            raise _NoFit(problem, limit, time_limit_s) from None
    else:
        sol = solve(problem, float("inf"), time_limit=time_limit_s)
    sol.solver["problem_s"] = t_problem
    sol.solver["plan_s"] = time.perf_counter() - t0
    plan = _make_plan(problem, sol, strategy, limit)
    if rc is not None:
        plan = dataclasses.replace(plan, recompute=rc)
    if strategy == "auto" and (float(sol.solver.get("mip_gap", 0.0)) > FAMILY_FALLBACK_GAP
                               or not plan.fits or (rc is not None and _rows_bind(sol))):
        plan = _best_with_families(traced, mesh, plan, memory_limit_bytes, pins, time_limit_s, rc)
    if compare_sharded and strategy == "auto" and not pins and plan.fully_replicated:
        plan = dataclasses.replace(plan, sharded_alternatives=sharded_families(
            traced, mesh, limit, min(time_limit_s, COMPARE_TIME_LIMIT_S)))
    return plan


# An automatic plan whose solve stopped (time limit) further than this from its bound, or whose
# exact peak exceeds the limit (the solver's rounds ran out of time before its memory rows
# caught the exact peak), or that needed recompute to fit and whose memory rows may have shaped
# it (``_rows_bind``: a model at the memory limit, where the solver's memory rows, which count a
# copy read by consumers in several groups once per group, can reject a plan whose exact peak
# fits), is compared with the hand-written families,
# planned with the same recompute choice and checked by the exact peak; a family plan that
# fits is kept when the search's does not, or when it is faster (the families are pins on the
# same problem, so the search would have found it given the time and exact rows).
FAMILY_FALLBACK_GAP = 0.02


def _rows_bind(sol: Solution) -> bool:
    """Whether the search's memory rows may have shaped its plan: not when the LP optimum was
    integral and no memory row is at the limit there (then the plan is the optimum without
    any memory rows, so no family, being pins on the same problem, is faster). On the 70B
    steps this spares a family plan of 10-12 s."""
    return not (sol.solver.get("method") == "lp-integral"
                and float(sol.solver.get("memory_rows_use", 1.0)) < 1.0 - 1e-6)


def _best_with_families(traced: Graph, mesh: Mesh, plan: Plan, memory_limit_bytes: int | None,
                        pins: Pins | None, time_limit_s: float,
                        rc: tuple[str, tuple[str, ...]] | None) -> Plan:
    best, gap = plan, float(plan.solver.get("mip_gap", 0.0))
    tried = []
    prepared = _prepared(traced, rc)
    for family in HAND_STRATEGIES:
        # a family that cannot fit (``peak_lower_bound`` with its state at the family's
        # layouts) is not planned, as it could not be kept: on the 70B step on 256 GPUs, dp
        # and megatron_tp were two full searches of about 20 s each for that answer
        try:
            bound = peak_lower_bound(prepared, mesh, hand_pins(prepared, mesh, family))
            if bound > plan.memory_limit_bytes:
                tried.append(f"{family} (cannot fit: at least {format_bytes(bound)})")
                continue
            alt = _plan_on(traced, mesh, family, memory_limit_bytes, pins, time_limit_s, False,
                           rc)
        except PlanError:
            continue
        tried.append(f"{family} {alt.estimated_step_time_s * 1e3:.3f} ms"
                     f"{'' if alt.fits else ' (does not fit)'}")
        if alt.fits and (not best.fits or alt.estimated_step_time_s < best.estimated_step_time_s):
            best = alt
    note = (f"the search stopped {gap:.1%} from its bound at "
            f"{plan.estimated_step_time_s * 1e3:.3f} ms"
            f"{'' if plan.fits else f' (peak {format_bytes(plan.peak_memory_bytes)}: no fit)'}"
            f"; families: {', '.join(tried) or 'none'}"
            f"; kept: {'the search' if best is plan else best.strategy}")
    if best is not plan:
        best = dataclasses.replace(best, strategy="auto", solver={**best.solver,
                                                                  "searched_gap": gap})
    best.solver["families"] = note
    logger.info("planning %s: %s", traced.info.name, note)
    return best


# ---- activation recompute ---------------------------------------------------------------------

# ``recompute="auto"``: when no plan without recompute fits the memory limit, the step is
# planned again with selective recompute of every repeated layer, then full recompute if
# selective does not fit; the policy that fits is then tried on fewer layers (as many as the
# peaks say it needs, or half) and that plan is kept when it fits and is faster. A plan that
# fits without recompute is kept as it is: whether recompute would let a layout with less
# communication fit (a tight data-parallel plan against FSDP) is not searched, because it
# would plan every memory-bound step twice (measured: 22 s -> 37 s for the GPT on dp=2,tp=2).
# The share of the limit the layer count is aimed at:
RECOMPUTE_TARGET = 0.95


def check_recompute(recompute: object) -> None:
    ok = recompute == "auto" or recompute in RECOMPUTE_POLICIES or (
        isinstance(recompute, tuple) and len(recompute) == 2
        and recompute[0] in RECOMPUTE_POLICIES and not isinstance(recompute[1], str))
    if not ok:
        raise PlanError(f"recompute must be 'auto', one of {RECOMPUTE_POLICIES} or (policy, "
                        f"layers), got {recompute!r}")


def _plan_recompute(graph: Graph, mesh: Mesh, strategy: str, memory_limit_bytes: int | None,
                    pins: Pins | None, time_limit_s: float, compare_sharded: bool,
                    recompute: str | tuple[str, Sequence[str]]) -> Plan:
    """``_plan_on`` with the recompute choice made (``plan_graph``'s ``recompute``)."""
    layers = repeated_layers(_prepared(graph))

    def attempt(rc: tuple[str, tuple[str, ...]] | None, may_skip: bool = False
                ) -> Plan | _NoFit:
        try:
            plan = _plan_on(graph, mesh, strategy, memory_limit_bytes, pins, time_limit_s,
                            compare_sharded, rc, may_skip)
        except _NoFit as e:
            return e
        if rc is not None:
            plan.solver["recompute"] = _recompute_note(plan, len(layers))
        return plan

    if recompute != "auto":
        policy, which = ((recompute, layers) if isinstance(recompute, str)
                         else (recompute[0], tuple(recompute[1])))
        if policy != "none" and not which:
            raise PlanError(f"recompute={recompute!r}: {graph.info.name} has no repeated layers "
                            "to recompute (modules numbered like layers.0, layers.1)")
        got = attempt(None if policy == "none" else (policy, tuple(which)))
        if isinstance(got, _NoFit):
            _raise_no_fit(graph, mesh, got, layers, tried=() if policy == "none" else (policy,))
        return got
    # a family's plans report ``fits`` rather than failing, so its solves run whatever the
    # limit; but where its lower bound already misses it, the policies before the last are
    # not solved (on LLaMA-3 405B's Megatron stages, 13-18 s each)
    skip = strategy != "auto" and bool(layers)
    base = attempt(None, skip)
    if not layers or (isinstance(base, Plan) and (base.fits or _state_bytes(base)
                                                  >= base.memory_limit_bytes)):
        if isinstance(base, _NoFit):
            _raise_no_fit(graph, mesh, base, layers, tried=())
        return base
    plans = [base] if isinstance(base, Plan) else []
    last: Plan | _NoFit = base
    tried: list[str] = []
    for policy in ("selective", "full"):
        tried.append(policy)
        last = attempt((policy, layers), skip and policy != "full")
        if isinstance(last, Plan):
            plans.append(last)
            if last.fits:
                break
    if not plans:
        assert isinstance(last, _NoFit)
        _raise_no_fit(graph, mesh, last, layers, tried=tuple(tried))
    best = min(plans, key=_rank)
    if best.recompute is not None and best.fits and len(layers) > 1:
        k = _layers_needed(base, best, len(layers))
        if k < len(layers):
            # (a family's plan the lower bound rules out cannot beat ``best``, which fits)
            fewer = attempt((best.recompute[0], layers[:k]), skip)
            if isinstance(fewer, Plan) and _rank(fewer) < _rank(best):
                best = fewer
    if best.recompute is not None:
        without = (f"peak {format_bytes(base.peak_memory_bytes)}, "
                   f"{base.estimated_step_time_s * 1e3:.3f} ms" if isinstance(base, Plan)
                   else f"at least {format_bytes(base.bound)} per device, over the "
                   f"{format_bytes(base.limit)} limit" if base.bound is not None
                   else f"no plan fits {format_bytes(base.limit)}")
        best.solver["recompute"] += f"; without recompute: {without}"
    return best


def _state_bytes(plan: Plan) -> int:
    """Bytes per device of the state ``plan`` holds through the step (parameters, buffers,
    gradients, optimizer state): what no recompute can free. A step that makes its gradients
    (``zero_grad(set_to_none=True)``) holds one per parameter at the update: counted at the
    parameter's layout."""
    from ._report import memory_breakdown

    held = memory_breakdown(plan)
    return (held["parameters_bytes"] + (held["gradients_bytes"] or held["parameters_bytes"])
            + held["optimizer_state_bytes"] + held["buffers_bytes"])


def _rank(plan: Plan) -> tuple[bool, float]:
    """Fitting plans first, fastest first; then the others, lowest peak first."""
    return (False, plan.estimated_step_time_s) if plan.fits else (True, plan.peak_memory_bytes)


def _layers_needed(base: Plan | _NoFit, best: Plan, n: int) -> int:
    """How many layers ``best``'s policy needs, from the peaks with none and with all (when
    the plan without recompute is known), else half of them; at least one."""
    if not isinstance(base, Plan) or base.peak_memory_bytes <= best.peak_memory_bytes:
        return max(1, n // 2)
    per_layer = (base.peak_memory_bytes - best.peak_memory_bytes) / n
    missing = base.peak_memory_bytes - RECOMPUTE_TARGET * best.memory_limit_bytes
    return max(1, min(n, math.ceil(missing / per_layer)))


def recompute_cost(plan: Plan) -> tuple[float, int]:
    """(seconds of recomputed forward per step, bytes of activations the plan no longer
    holds when the backward starts) of ``plan``'s activation recompute."""
    if plan.recompute is None:
        return 0.0, 0
    graph, sizes = plan.graph, plan.mesh.sizes
    placed = {p.node: p for p in plan.placements}
    copies = [n for n in graph.nodes if n.name.startswith(RECOMPUTE_PREFIX)
              and n.name[len(RECOMPUTE_PREFIX):] in graph]
    seconds = sum(placed[n.name].compute_s for n in copies if n.name in placed)
    start = next((i for i, n in enumerate(graph.nodes) if n.phase is Phase.BACKWARD), 0)
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    last: dict[str, int] = {}
    for i, n in enumerate(graph.nodes):
        for r in n.refs():
            last[r.node] = i
    freed = 0
    for n in copies:
        name = n.name[len(RECOMPUTE_PREFIX):]
        if last.get(name, 0) >= start or name not in placed or is_follower(graph, n):
            continue          # the original is still read in the backward, or is a view
        for meta, layout in zip(graph.node(name).outputs, placed[name].outputs):
            if isinstance(meta, TensorMeta) and order[name] < start:
                freed += int(meta.nbytes / (layout_fraction(layout, sizes) if layout else 1))
    return seconds, freed


def _recompute_note(plan: Plan, n_layers: int) -> str:
    policy, which = plan.recompute
    seconds, freed = recompute_cost(plan)
    return (f"{policy} on {len(which)} of {n_layers} layers ({_layer_span(which)}): recomputes "
            f"{seconds * 1e3:.3f} ms of forward per step, holds {format_bytes(freed)} less "
            "activation memory when the backward starts")


def _layer_span(which: Sequence[str]) -> str:
    if len(which) <= 2:
        return ", ".join(which)
    return f"{which[0]} ... {which[-1]}"


def _raise_no_fit(graph: Graph, mesh: Mesh, e: _NoFit, layers: Sequence[str],
                  tried: Sequence[str]) -> NoReturn:
    best = min_peak_memory(e.problem(), time_limit=e.time_limit_s)
    if tried:
        rc = (f"activation recompute ({' and '.join(tried)} of the {len(layers)} layers; "
              f"the best peak is with {tried[-1]})")
        rest = "pipeline stages (a 'pp' mesh axis: planner.plan_pipeline), offloading"
    elif layers:
        rc = None
        rest = ("activation recompute (recompute='auto' tries it), pipeline stages (a 'pp' "
                "mesh axis: planner.plan_pipeline), offloading")
    else:
        rc = None
        rest = ("activation recompute (the step has no repeated layers: modules numbered "
                "like layers.0, layers.1), pipeline stages, offloading")
    raise PlanError(
        f"no plan of {graph.info.name} fits {format_bytes(e.limit)} per device on mesh "
        f"{mesh}: the best plan needs {format_bytes(best)} (misses by "
        f"{format_bytes(best - e.limit)}). Searched: every layout of the state, the "
        "batch and the activations over the mesh's axes (data, FSDP/ZeRO, tensor and "
        f"sequence sharding){'; ' + rc if rc else ''}; not searched yet: {rest}. Use a larger "
        "mesh, a smaller batch, lower-precision state, or raise memory_limit_bytes")


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
    """Per-tensor ops instead of foreach ops: each parameter's update can be placed alone;
    gradient casts where the gradient is made (``ir.hoist_casts``)."""
    return hoist_casts(split_foreach(graph))


def _prepared(graph: Graph, rc: tuple[str, tuple[str, ...]] | None = None) -> Graph:
    """``_prepare(graph)``, with ``rc``'s recompute applied; made once per planning session."""
    memo = getattr(_session, "memo", None)
    key = (id(graph), rc)
    if memo is not None and key in memo and memo[key][0] is graph:
        return memo[key][1]
    # (every recompute choice starts from the one prepared graph)
    out = _prepare(graph) if rc is None else recompute_graph(_prepared(graph), *rc)
    if memo is not None:
        memo[key] = (graph, out)          # the traced graph too: its id stays its own
    return out


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
    done: set[tuple[str, int, Layout, Layout, bool]] = set()
    for e in problem.all_edges() + problem.folded:
        src = chosen[e.src].outputs[e.index]
        dst = chosen[e.dst].outputs[0] if e.pos == STATE_POS else chosen[e.dst].inputs[e.pos]
        # one change per value and target layout serves all its consumers in the forward,
        # and one all its later consumers (the lowering keeps a changed value for its
        # readers in the forward, frees it after the last, and changes it again for the
        # backward, as FSDP gathers parameters again): listed, and paid, once each
        forward = e.pos != STATE_POS and graph.node(e.dst).phase is Phase.FORWARD
        if src != dst and (e.src, e.index, src, dst, forward) not in done:
            done.add((e.src, e.index, src, dst, forward))
            consumer = f"<state {graph.node(e.dst).target}>" if e.pos == STATE_POS else e.dst
            redistributions.append(_redistribution(problem, Ref(e.src, e.index), consumer,
                                                   src, dst))
    rep = tuple(R for _ in mesh.sizes)
    for ref in result_refs(graph):
        if ref.node in chosen and chosen[ref.node].outputs[ref.index] != rep:
            redistributions.append(_redistribution(problem, ref, "<result>",
                                                   chosen[ref.node].outputs[ref.index], rep))
    bucket_bytes = plan_bucket_bytes(mesh, redistributions)
    # as the lowering runs them: the all-reduces it merges into buckets cost one call each
    comm = float(comm_time(mesh, graph, redistributions, bucket_bytes))
    overhead = mesh.topology.step_overhead_s       # a calibrated machine's; presets: 0
    return Plan(
        mesh=mesh, strategy=strategy, graph=graph, placements=tuple(placements),
        redistributions=tuple(redistributions),
        estimated_step_time_s=sol.compute_s + comm + overhead, compute_time_s=sol.compute_s,
        comm_time_s=comm, peak_memory_bytes=sol.peak_memory_bytes, memory_limit_bytes=limit,
        fallbacks=tuple(problem.fallbacks), solver=dict(sol.solver),
        bucket_bytes=bucket_bytes,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ReductionBucket:
    """All-reduces the lowering merges into one call (``backends/_bucket.py``): indices into a
    plan's redistributions, the mesh axis, the bytes, and whether it runs behind the rest of
    the step (its readers deferred to the end: the gradients' buckets)."""

    members: tuple[int, ...]
    axis: str
    nbytes: float
    deferred: bool
    # its wire time may run under compute: deferred, and not its axis's last deferred bucket
    # (that one starts only once the backward has made its last gradient)
    overlaps: bool = False

    def time_s(self, mesh: Mesh) -> float:
        """Its one call on ``mesh``, the topology's ``comm_overlap`` of its wire time hidden
        when it overlaps."""
        a = mesh.names.index(self.axis)
        return bucket_call_time(self.nbytes, mesh.sizes[a], mesh.link(a),
                                mesh.topology.comm_overlap if self.overlaps else 0.0)


def reduction_buckets(graph: Graph, mesh: Mesh, redistributions: Sequence[Redistribution],
                      bucket_bytes: int | None) -> list[ReductionBucket]:
    """The buckets ``backends._bucket.bucket`` makes of ``redistributions`` when it lowers
    them, worked out on the graph: candidates are the redistributions that are one floating
    sum/avg all-reduce (each value and target layout once); one that no other candidate
    depends on has its readers deferred to the end of the step (``defer_readers``); in the
    order their values are made, each joins the open bucket of its axis, op and dtype unless
    a member of that bucket is read before it is made or it would take the bucket above
    ``bucket_bytes`` (None: the lowering's default cap)."""
    cap = bucket_bytes or DEFAULT_BUCKET_BYTES
    pos = {n.name: i for i, n in enumerate(graph.nodes)}
    # (value, target layout) -> (bucket key: axis, op, dtype; bytes; redistribution indices)
    cands: dict[tuple, tuple[tuple, float, list[int]]] = {}
    for i, r in enumerate(redistributions):
        if len(r.collectives) != 1 or r.collectives[0][0] != Collective.ALL_REDUCE.value:
            continue
        ref = Ref.parse(r.value)
        meta = graph.meta(ref)
        _, axis, nbytes = r.collectives[0]
        op = getattr(r.src[mesh.names.index(axis)], "op", None)
        if (not isinstance(meta, TensorMeta) or not meta.dtype.startswith(("float", "bfloat"))
                or op is None or op.value not in ("sum", "avg") or ref.node not in pos):
            continue
        cands.setdefault((r.value, r.dst), ((axis, op.value, meta.dtype), nbytes * r.count,
                                            []))[2].append(i)
    if not cands:
        return []
    bit = {ref: 1 << k for k, ref in enumerate({Ref.parse(v).node for v, _ in cands})}
    # below[n]: the candidates' value nodes reachable from node n (n included)
    users = graph.users
    below: dict[str, int] = {}
    for node in reversed(graph.nodes):
        m = bit.get(node.name, 0)
        for u in users.get(node.name, ()):
            m |= below.get(u, 0)
        below[node.name] = m
    end = len(graph.nodes)
    info = []
    for (value, _), (key, nbytes, idx) in cands.items():
        node = Ref.parse(value).node
        readers = [redistributions[i].consumer for i in idx]
        after = 0
        for c in readers:
            after |= below.get(c, 0)
        inside = bool(after & ~bit[node])        # another candidate depends on this one
        first = min((pos[c] for c in readers if c in pos), default=end) if inside else end
        info.append((pos[node], idx, key, nbytes, not inside, first))
    info.sort(key=lambda t: (t[0], t[1][0]))
    opened: dict[tuple, dict] = {}
    out: list[dict] = []
    for made, idx, key, nbytes, deferred, first in info:
        b = opened.get(key)
        if b is not None and (made >= b["wait"] or (b["bytes"] and b["bytes"] + nbytes > cap)):
            b = None
        if b is None:
            b = opened[key] = {"members": [], "bytes": 0.0, "wait": end + 1, "axis": key[0],
                               "deferred": True}
            out.append(b)
        b["members"] += idx
        b["bytes"] += nbytes
        b["wait"] = min(b["wait"], first)
        b["deferred"] = b["deferred"] and deferred
    last = {b["axis"]: k for k, b in enumerate(out) if b["deferred"]}
    return [ReductionBucket(tuple(b["members"]), b["axis"], b["bytes"], b["deferred"],
                            b["deferred"] and last[b["axis"]] != k)
            for k, b in enumerate(out)]


def comm_time(mesh: Mesh, graph: Graph, redistributions: Sequence[Redistribution],
              bucket_bytes: int | None) -> float:
    """Seconds of communication a step's ``redistributions`` cost as the lowering runs them:
    each its own collectives, except the all-reduces it merges (``reduction_buckets``): one
    call per bucket (one latency and wait, not one per gradient), with the topology's
    ``comm_overlap`` of an overlapping bucket's wire time hidden under compute, as
    ``bucket_time`` prices a data-parallel step."""
    buckets = reduction_buckets(graph, mesh, redistributions, bucket_bytes)
    merged = {i for b in buckets for i in b.members}
    return float(sum(r.time_s * r.count for i, r in enumerate(redistributions)
                     if i not in merged) + sum(b.time_s(mesh) for b in buckets))


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
