"""The global ILP: one strategy per decision (shared by repeated layers), layout changes on
edges priced by the alpha-beta model, a per-rank memory limit, solved with HiGHS.

Edges use the transport form: for an edge whose producer offers output layouts L and whose
consumer asks for layouts R, continuous ``y[l, r] >= 0`` with row sums equal to the producer's
layout indicator and column sums equal to the consumer's. With one-hot indicators the only
solution is their product, so the LP relaxation is much tighter than ``y >= a + b - 1``.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import highspy
import numpy as np

from .._errors import PlanError
from ..ir import Graph, NodeKind, Phase, Ref, TensorMeta
from ._mesh import Mesh
from ._placement import Layout, Partial, R, Shard, layout_fraction
from ._summary import format_bytes
from ._problem import (INF, STATE_POS, Edge, Problem, has_partial, held_once, reduce_wide,
                       reduces, reshard_steps, reshard_time, result_refs)

# what the solver adds for a collective outside a hand-written family's own (Problem.collectives)
# is this many times the model's whole cost (every variable at 1, which no plan exceeds): above
# any step time it compares, so only a plan that cannot do without pays it (the plan's reported
# times are computed from its redistributions, without the penalty). It is relative, not a
# fixed 1e3 s: next to the few-microsecond ops of a small model a 1e3 s cost left the LP so
# badly scaled (costs 4e-3..3e9 us) that HiGHS's dual simplex stopped with status Unknown
FAMILY_PENALTY = 2.0

# ``solve`` leaves the memory rows out of its first round when the unsharded liveness peak,
# spread over every device (the bound ``peak_lower_bound`` gives), is under this share of the
# limit: plans then mostly fit without them. Measured: LLaMA-3 8B (fp32) on dp 8 x tp 8 is at
# 0.07 and its plan peaks at 0.24 of the limit; the 70B steps of the scale table, at 0.41-0.49,
# peak at 0.74-0.90, and a first round without rows there cost a second solve
LAZY_MEMORY_SHARE = 0.25

logger = logging.getLogger(__name__)


@dataclass
class Solution:
    choice: dict[str, int]                # node -> index into its decision's choices
    compute_s: float
    peak_memory_bytes: int
    solver: dict[str, float | int | str] = field(default_factory=dict)


GIB = float(2**30)
DIVE_GAP = 0.01      # a dive within 1% of the LP bound is accepted without branch and bound
COST_SCALE = 1e6     # the LP's objective is in microseconds: well scaled for HiGHS's tolerances
PRICE_EPS = 1e-6     # reduced cost (microseconds) below which a priced-out column enters
# at most this many columns enter per round, the most negative first: 1000 -> 5000 cut the 8B
# LP on dp 8 x tp 8 from 6.8 s to 4.5 s and every scale-table row but one (70B on 256 H100s
# lands on another optimal vertex, same estimate: 14 s -> 18 s); no cap at all was no faster
PRICE_BATCH = 5000
# HiGHS's parallel dual simplex (PAMI) on 2 threads where 2 CPUs are usable: LLaMA-3 8B on
# dp8 x tp8 solves in 5.3-5.7 s instead of 7.3 s, the same plan in every run (checked: 3
# runs, and tests/unit/test_planner.py's serial-vs-parallel check); on one CPU it is ~20 %
# slower, and on LPs of a few thousand columns it gains nothing (the planner's unit tests: 28 s
# either way), so it runs from PAMI_MIN_COLUMNS up where 2 CPUs are usable and the load
# average leaves one free (``lp_threads``: beside other work it was up to 20x slower).
# MESHPLAN_LP_THREADS=1 forces the serial dual, =2 PAMI.
ENV_LP_THREADS = "MESHPLAN_LP_THREADS"
PAMI_MIN_COLUMNS = 20_000


def lp_threads() -> int:
    """The simplex threads the LP uses: 2 where 2 CPUs are usable and the machine is not
    busy (the last minute's load average leaves a CPU free beside this process), else 1.
    PAMI's threads wait for each other: with the CPUs taken by other work it ran 20x slower
    than the serial dual (Megatron's GPT plan on dp2 x tp2: 8.6 s against 0.46 s, beside a
    2-process training job on this 2-core VM; idle, 0.44 s both)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    asked = os.environ.get(ENV_LP_THREADS)
    if asked is not None and asked.strip().isdigit():
        return max(1, min(int(asked), 2))
    try:
        busy = os.getloadavg()[0]
    except OSError:
        busy = 0.0
    return 2 if usable >= 2 and busy <= usable - 0.5 else 1


class _Model:
    def __init__(self) -> None:
        self.groups: list[list[int]] = []
        self.cost: list[float] = []
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.integer: list[bool] = []
        self.lazy: list[bool] = []
        self.rows: list[tuple[float, float, list[int], list[float]]] = []
        self.penalized: dict[int, float] = defaultdict(float)   # variable -> penalty units
        self.memory_rows = range(0)     # the rows that bound memory at the liveness points

    def var(self, cost: float, integer: bool, lazy: bool = False) -> int:
        """A new variable in [0, 1]. A ``lazy`` one starts priced out (held at 0) and enters
        the LP only when its reduced cost says it would lower the objective."""
        self.cost.append(cost)
        self.lb.append(0.0)
        self.ub.append(1.0)
        self.integer.append(integer)
        self.lazy.append(lazy)
        return len(self.cost) - 1

    def row(self, lo: float, hi: float, terms: dict[int, float]) -> None:
        idx = [i for i, v in terms.items() if v != 0.0]
        self.rows.append((lo, hi, idx, [terms[i] for i in idx]))

    def solve(self, time_limit: float, gap: float) -> tuple[list[float], dict]:
        """LP relaxation first, by column generation: the lazy variables start priced out and
        enter while their reduced cost is negative, so the LP optimum (and bound) is that of
        the whole model. The transport form makes it integral on most plans, which proves
        optimality at LP cost. A fractional LP is rounded by diving (fix the most decided
        groups, re-solve from the warm basis, repeat); if the dive lands within ``DIVE_GAP``
        of the LP bound it is kept, else branch and bound starts from it over the columns
        that entered. The reported gap is always against the whole model's LP bound."""
        t0 = time.perf_counter()
        deadline = t0 + time_limit
        h = self._highs(time_limit, gap)
        h.setOptionValue("solver", "simplex")      # warm re-solves as columns enter
        out = np.array([i for i, z in enumerate(self.lazy) if z], dtype=np.int32)
        if len(out):
            h.changeColsBounds(len(out), out, np.zeros(len(out)), np.zeros(len(out)))
        out, priced = self._price(h, out, deadline)
        values, stats = self._result(h, integer=False)
        if h.getModelStatus() == highspy.HighsModelStatus.kTimeLimit:
            # an LP stopped mid-way is not a plan (its iterate reported a negative cost once):
            # no values, and the caller says the solver ran out of time
            stats["solve_s"] = time.perf_counter() - t0
            return [], stats
        stats["columns"] = len(self.cost) - len(out)
        stats["pricing_rounds"] = priced
        ints = [i for i, b in enumerate(self.integer) if b]
        if not values or not ints or self._integral(values):
            stats.update(solve_s=time.perf_counter() - t0, method="lp-integral", mip_gap=0.0)
            return values, stats
        bound = stats["objective"]
        dive = self._dive(h, values, t0 + time_limit / 2)
        if dive:
            values, stats = dive
            dgap = (stats["objective"] - bound) / max(abs(stats["objective"]), 1e-30)
            if dgap <= max(gap, DIVE_GAP):
                stats.update(solve_s=time.perf_counter() - t0, method="lp-dive",
                             mip_gap=max(0.0, dgap))
                return values, stats
        left = max(1.0, time_limit - (time.perf_counter() - t0))
        h = self._highs(left, gap)
        if len(out):
            h.changeColsBounds(len(out), out, np.zeros(len(out)), np.zeros(len(out)))
        idx = np.array(ints, dtype=np.int32)
        h.changeColsIntegrality(len(idx), idx,
                                np.array([highspy.HighsVarType.kInteger] * len(idx)))
        if dive:
            start = highspy.HighsSolution()
            start.col_value = list(dive[0])
            h.setSolution(start)
        h.run()
        mip, mstats = self._result(h, integer=True)
        if mip and (not dive or mstats["objective"] <= dive[1]["objective"]):
            values, stats = mip, mstats
        elif not mip and not dive:
            # no integral plan in time: what stands is the fractional LP, rounded per group by
            # the caller; its objective is the bound, not the plan's, so no gap is claimed
            # (it reported 0 here: a 5 s limit on the GPT d512 "proved" a rounded LP optimal)
            stats.update(solve_s=time.perf_counter() - t0, method="lp-rounded", mip_gap=1.0)
            return values, stats
        stats["mip_gap"] = max(0.0, (stats["objective"] - bound)
                               / max(abs(stats["objective"]), 1e-30))
        stats.update(solve_s=time.perf_counter() - t0, method="mip")
        return values, stats

    def _price(self, h: highspy.Highs, out: np.ndarray, deadline: float) -> tuple[np.ndarray, int]:
        """Solve the LP, let the priced-out columns with a negative reduced cost in, repeat.
        Returns the columns still out and the number of rounds. If the columns in cannot meet
        the constraints (a tight memory limit), all enter at once."""
        rounds = 0
        while True:
            rounds += 1
            h.setOptionValue("time_limit", max(1.0, deadline - time.perf_counter()))
            h.run()
            if not len(out):
                return out, rounds
            if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
                if h.getModelStatus() == highspy.HighsModelStatus.kTimeLimit:
                    return out, rounds
                enter = out                            # infeasible without them: all in
            else:
                reduced = np.asarray(h.getSolution().col_dual)[out]
                neg = np.flatnonzero(reduced < -PRICE_EPS)
                if len(neg) > PRICE_BATCH:      # partial pricing: the most negative first
                    neg = neg[np.argsort(reduced[neg])[:PRICE_BATCH]]
                enter = out[neg]
            if not len(enter):
                return out, rounds
            h.changeColsBounds(len(enter), enter, np.zeros(len(enter)), np.ones(len(enter)))
            out = np.setdiff1d(out, enter).astype(np.int32)

    def group(self, variables: list[int]) -> None:
        """Declare a one-hot group (exactly one of ``variables`` is 1), used by the dive."""
        self.groups.append(variables)

    def _integral(self, values: list[float]) -> bool:
        return all(min(values[i], 1 - values[i]) < 1e-6 for i, b in enumerate(self.integer)
                   if b)

    def _dive(self, h: highspy.Highs, values: list[float],
              deadline: float) -> tuple[list[float], dict] | None:
        while time.perf_counter() < deadline:
            frac = [g for g in self.groups if max(values[v] for v in g) < 1 - 1e-6]
            if not frac:
                return values, self._result(h, integer=False)[1]
            frac.sort(key=lambda g: -max(values[v] for v in g))
            batch = frac[:max(1, len(frac) // 4)]
            for size in (len(batch), 1):
                fixed = self._fix(h, batch[:size], values)
                h.run()
                nv, _ = self._result(h, integer=False)
                if nv:
                    values = nv
                    break
                self._unfix(h, fixed)
            else:
                return None
        return None

    def _fix(self, h: highspy.Highs, groups: list[list[int]],
             values: list[float]) -> list[int]:
        cols, lo, hi = [], [], []
        for g in groups:
            best = max(g, key=lambda v: values[v])
            for v in g:
                cols.append(v)
                lo.append(1.0 if v == best else 0.0)
                hi.append(1.0 if v == best else 0.0)
        h.changeColsBounds(len(cols), np.array(cols, dtype=np.int32), np.array(lo),
                           np.array(hi))
        return cols

    def _unfix(self, h: highspy.Highs, cols: list[int]) -> None:
        h.changeColsBounds(len(cols), np.array(cols, dtype=np.int32), np.zeros(len(cols)),
                           np.ones(len(cols)))

    def _highs(self, time_limit: float, gap: float) -> highspy.Highs:
        h = _new_highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("time_limit", float(time_limit))
        if lp_threads() > 1 and len(self.cost) >= PAMI_MIN_COLUMNS:
            h.setOptionValue("simplex_strategy", 2)          # the parallel dual (PAMI)
            h.setOptionValue("simplex_min_concurrency", 2)
            h.setOptionValue("simplex_max_concurrency", 2)
        h.setOptionValue("mip_rel_gap", float(gap))
        n = len(self.cost)
        h.addVars(n, np.array(self.lb), np.array(self.ub))
        h.changeColsCost(n, np.arange(n, dtype=np.int32), np.array(self.cost) * COST_SCALE)
        starts, index, value, lo, hi = [], [], [], [], []
        for rlo, rhi, idx, val in self.rows:
            starts.append(len(index))
            index += idx
            value += val
            lo.append(rlo)
            hi.append(rhi)
        h.addRows(len(lo), np.array(lo), np.array(hi), len(index),
                  np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32),
                  np.array(value, dtype=np.float64))
        return h

    def _result(self, h: highspy.Highs, integer: bool) -> tuple[list[float], dict]:
        status = h.getModelStatus()
        info = h.getInfo()
        stats = {"status": h.modelStatusToString(status), "variables": len(self.cost),
                 "constraints": len(self.rows),
                 "mip_gap": float(info.mip_gap) if integer else 0.0,
                 "objective": float(info.objective_function_value) / COST_SCALE}
        ok = status in (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kTimeLimit)
        if not ok or info.primal_solution_status != 2:
            return [], stats
        return list(h.getSolution().col_value), stats


_banner_shown = False


def _new_highs() -> highspy.Highs:
    """A HiGHS instance; the first in a process prints a banner on the C-level stdout, before
    any option can silence it, which would corrupt ``--json`` output: it goes to /dev/null."""
    global _banner_shown
    if _banner_shown:
        return highspy.Highs()
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)
    _banner_shown = True
    return h


def solve(problem: Problem, memory_limit: float, *, time_limit: float = 60.0,
          gap: float = 1e-4, memory_points: int = 6, max_rounds: int = 6) -> Solution:
    """Choose a strategy per node; raise PlanError if no choice fits ``memory_limit``.

    Memory is constrained at the peaks of the unsharded liveness profile; if the solution's
    exact peak lands elsewhere and exceeds the limit, that point is added and the ILP re-solved.
    Where memory is unlikely to bind (the unsharded peak spread over every device is under
    ``LAZY_MEMORY_SHARE`` of the limit), the first round has no memory rows at all: a plan
    whose exact peak then fits is optimal under the limit too, and the rows (dense: every live
    value's every choice) slow the simplex several times (LLaMA-3 8B on dp 8 x tp 8: 52 s ->
    13 s); a plan that does not fit gets the rows in the next round.
    ``time_limit`` bounds all rounds together (each solve gets what is left, at least 1 s); when
    it runs out, the last round's plan stands (its exact peak says whether it fits).
    """
    whole = _whole_profile(problem)                    # the spread peak: peak_lower_bound's
    lazy = memory_limit < INF and max(whole, default=0.0) / problem.mesh.size \
        < LAZY_MEMORY_SHARE * memory_limit
    points = [] if lazy else _memory_points(whole, memory_points)
    t_build = t_solve = 0.0
    deadline = time.perf_counter() + time_limit
    for rounds in range(1, max_rounds + 1):
        t0 = time.perf_counter()
        model, xvar, members, _ = _build(problem, memory_limit, points)
        t_build += time.perf_counter() - t0
        values, stats = model.solve(max(1.0, deadline - time.perf_counter()), gap)
        t_solve += stats["solve_s"]
        if not values and stats["status"] != "Infeasible":
            raise PlanError(
                f"the solver found no plan within {time_limit:.0f} s ({stats['status']}, "
                f"{stats['variables']} variables); raise time_limit_s or use a hand strategy")
        if not values:
            raise PlanError(
                "no plan fits: the solver found no assignment within the memory limit of "
                f"{format_bytes(memory_limit)} per device ({stats['status']})")
        choice: dict[str, int] = {}
        for g, names in members.items():
            best = int(np.argmax([values[v] for v in xvar[g]]))
            for name in names:
                choice[name] = best
        peak, at = peak_memory(problem, choice)
        if peak <= memory_limit * (1 + 1e-9) or time.perf_counter() > deadline:
            break
        more = [t for t in dict.fromkeys(
            (_memory_points(whole, memory_points) if not points else []) + [at])
            if t not in points]
        if not more:
            break
        points += more
    dec = problem.decisions
    compute = sum(dec[n].choices[i].compute_s for n, i in choice.items())
    # the largest share of the limit a memory row gives the chosen plan: below 1 on an
    # integral LP optimum ("lp-integral"), no memory row binds, so it is also the optimum with
    # no memory rows at all (the LP is convex, and its optimum bounds every integral plan)
    stats["memory_rows_use"] = max(
        (sum(c * values[i] for i, c in zip(idx, val))
         for _, _, idx, val in (model.rows[r] for r in model.memory_rows)), default=0.0)
    stats.update(build_s=t_build, solve_s=t_solve, rounds=rounds,
                 decisions=len(dec), groups=len(members), memory_points=len(points))
    return Solution(choice, compute, peak, stats)


def peak_lower_bound(graph: Graph, mesh: Mesh, pins: dict[str, set[Layout]] | None = None) -> int:
    """Bytes per device below which no plan of ``graph`` on ``mesh`` peaks, without building
    its decisions: the peak of the memory model's liveness profile (its own live ranges, views
    counted as their source's storage) with every value at its ``1 / mesh.size`` piece, and
    each input that ``pins`` restricts (a hand-written family's state layouts, keyed by state
    name) at its smallest allowed piece. It holds because every value a plan keeps is at least
    that piece on each device over the same range (a partial value is whole, a layout change
    adds a copy, an early-reduced value's reduced copy spans its live range). It costs one pass
    over the graph, where a search that finds no plan builds every decision first (seconds on
    a 70B step, where recompute policies and families are tried until one fits)."""
    planned = {n.name: None for n in graph.nodes
               if n.kind in (NodeKind.INPUT, NodeKind.CONSTANT, NodeKind.OP)}
    problem = Problem(graph, mesh, planned, [], [])      # live ranges only: no decisions
    pins = pins or {}

    def size(name: str, idx: int) -> float:
        node = graph.node(name)
        meta = node.outputs[idx]
        allowed = pins.get(node.target) if node.kind is NodeKind.INPUT else None
        if allowed:
            return min(meta.nbytes / layout_fraction(l, mesh.sizes) for l in allowed)
        return meta.nbytes / mesh.size

    return int(max(_profile(problem, size), default=0.0))


def min_peak_memory(problem: Problem, *, time_limit: float = 60.0, max_rounds: int = 6) -> int:
    """The smallest per-rank peak any plan reaches: minimise the largest memory over the
    constrained liveness points, add the exact peak's point, repeat (as ``solve`` does)."""
    points = _memory_points(_whole_profile(problem), 6)
    live = problem.live_ranges
    best = None
    for _ in range(max_rounds):
        model, xvar, members, transients = _build(problem, INF, points)
        model.cost = [0.0] * len(model.cost)
        m = model.var(1.0, False)
        model.ub[m] = INF
        for t in points:
            terms = {v: b / GIB for v, b in _memory_terms(problem, xvar, t, live,
                                                          transients).items()}
            terms[m] = -1.0                    # m: the largest memory, in GiB
            model.row(-INF, 0.0, terms)
        values, stats = model.solve(time_limit, 1e-3)
        if not values:
            raise PlanError(f"could not compute the smallest memory of any plan "
                            f"({stats['status']})")
        choice = {}
        for g, names in members.items():
            pick = int(np.argmax([values[v] for v in xvar[g]]))
            for name in names:
                choice[name] = pick
        peak, at = peak_memory(problem, choice)
        best = peak if best is None else min(best, peak)
        if at in points:
            break
        points.append(at)
    assert best is not None
    return best


def _build(problem: Problem, memory_limit: float, points: list[int]) -> tuple[
        _Model, dict[int, list[int]], dict[int, list[str]], dict[int, dict[int, float]]]:
    dec = problem.decisions
    model = _Model()
    members: dict[int, list[str]] = defaultdict(list)
    for name, d in dec.items():
        members[d.group].append(name)
    xvar: dict[int, list[int]] = {}
    for g, names in members.items():
        n = len(dec[names[0]].choices)
        cost = [0.0] * n
        for name in names:
            choices = dec[name].choices
            assert len(choices) == n, f"unaligned choices in group {g}: {name}"
            for i, c in enumerate(choices):
                cost[i] += c.compute_s + c.comm_s
        xvar[g] = [model.var(c, True) for c in cost]
        model.row(1.0, 1.0, {v: 1.0 for v in xvar[g]})
        model.group(xvar[g])
    transients = _edge_rows(problem, model, xvar, points)
    _result_costs(problem, model, xvar)
    live = problem.live_ranges
    first = len(model.rows)
    for t in points if memory_limit < INF else ():
        terms = _memory_terms(problem, xvar, t, live, transients)
        # in units of the limit: bytes next to seconds would leave the LP badly scaled
        model.row(-INF, 1.0, {v: b / memory_limit for v, b in terms.items()})
    model.memory_rows = range(first, len(model.rows))
    if model.penalized:
        unit = FAMILY_PENALTY * max(sum(c for c in model.cost if c < INF), 1e-6)
        for v, units in model.penalized.items():
            model.cost[v] += units * unit
    return model, xvar, members, transients


def _edge_rows(problem: Problem, model: _Model, xvar: dict[int, list[int]],
               points: list[int]) -> dict[int, dict[int, float]]:
    """Edges grouped by (producer group, output, consumer group, position): one transport
    block per group, its cost times the number of edges it stands for. Returns the memory a
    layout change holds while its consumer runs, at the liveness ``points`` the memory rows
    constrain: point -> {variable: bytes}."""
    transients: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    graph, mesh, dec = problem.graph, problem.mesh, problem.decisions
    cache: dict[tuple[int, Layout, Layout], tuple[float, bool]] = {}

    def cost(nbytes: int, l: Layout, r: Layout) -> tuple[float, bool]:
        """The change's seconds, and whether it needs a collective outside the family's."""
        key = (nbytes, l, r)
        if key not in cache:
            steps = reshard_steps(TensorMeta((nbytes,), "uint8"), l, r, mesh)
            t = INF if steps is None else sum(s[3] for s in steps)
            cache[key] = (t, bool(steps) and problem.collectives is not None and any(
                k not in problem.collectives for k, *_ in steps))
        return cache[key]

    wide_values = reduce_wide(graph)
    early = problem.early_values
    order = problem.order
    # Edges are grouped by what they decide: the producer's group and output, the consumer's
    # group and the layout each of its choices needs. Consumers of one value that need the
    # same layouts (AdamW reads a gradient in three places) fall in one block, and the block
    # counts each value once: a value changed to a layout serves all of them, as in the
    # lowering. (Consumers in different groups still pay each.)
    # key -> (the producers, one edge, the edges' spans)
    blocks: dict[tuple, tuple[set[str], Edge, list[tuple[str, int, int, int, int]]]] = {}
    needs: dict[tuple[str, int], int] = {}
    sigs: dict[tuple, int] = {}       # the layouts a consumer's choices need, as a small int:
    by_ids: dict[tuple, int] = {}     # hashed once per reader, not once per dict use (and
    follower = problem.is_follower
    for e in problem.all_edges():     # once per list of Choice objects, which layers share)
        src, dst, pos = e.src, e.dst, e.pos
        s, d = dec[src], dec[dst]
        sig = needs.get((dst, pos))
        if sig is None:
            ids = (pos, *map(id, d.choices))
            sig = by_ids.get(ids)
            if sig is None:
                need = tuple(c.required(pos) for c in d.choices)
                sig = by_ids[ids] = sigs.setdefault(need, len(sigs))
            needs[(dst, pos)] = sig
        key = (s.group, s.cls, e.index, d.group, follower(dst), sig)
        block = blocks.get(key)
        if block is None:
            block = blocks[key] = (set(), e, [])
        block[0].add(src)
        block[2].append((src, order[src], _edge_time(problem, e), _edge_end(problem, e),
                         _orig_end(problem, e)))
    for key, (srcs, e, spans) in blocks.items():
        count = len(srcs)
        gs, gd, k, pos = key[0], key[3], e.index, e.pos
        meta = graph.meta(Ref(e.src, e.index))
        wide = (e.src, e.index) in wide_values   # the same producer op across the group
        held = _Held(spans, points, {(n, k) for n in srcs} & early, k)
        if gs == gd:       # both ends read one decision: the change is fixed by the choice
            for i, (cs, cd) in enumerate(zip(dec[e.src].choices, dec[e.dst].choices)):
                l, r = cs.outputs[k], cd.required(pos)
                if l != r:
                    t, odd = (INF, False) if wide and reduces(l, r) else cost(meta.nbytes, l, r)
                    if t == INF:
                        model.ub[xvar[gs][i]] = 0.0
                        continue
                    model.cost[xvar[gs][i]] += count * t
                    if odd:
                        model.penalized[xvar[gs][i]] += count
                for when, b in held.bytes(meta, l, r, mesh.sizes).items():
                    transients[when][xvar[gs][i]] += b
            continue
        by_out: dict[Layout, list[int]] = defaultdict(list)
        for i, c in enumerate(dec[e.src].choices):
            by_out[c.outputs[k]].append(xvar[gs][i])
        by_in: dict[Layout, list[int]] = defaultdict(list)
        for i, c in enumerate(dec[e.dst].choices):
            by_in[c.required(pos)].append(xvar[gd][i])
        ys: dict[tuple[Layout, Layout], int] = {}
        follower = problem.is_follower(e.dst)
        for l, r in candidate_pairs(tuple(by_out), tuple(by_in), follower):
            t, odd = (INF, False) if wide and reduces(l, r) else cost(meta.nbytes, l, r)
            if t < INF:
                # keeping, slicing and gathering are in from the start; reduce-scatters
                # and all-to-alls are priced in when they pay
                lazy = not (l == r or _gathered(l, r) or _gathered(r, l))
                ys[(l, r)] = model.var(count * t, False, lazy)
                if odd:
                    model.penalized[ys[(l, r)]] += count
                for when, b in held.bytes(meta, l, r, mesh.sizes).items():
                    transients[when][ys[(l, r)]] += b
        rows_out: dict[Layout, dict[int, float]] = {l: {} for l in by_out}
        rows_in: dict[Layout, dict[int, float]] = {r: {} for r in by_in}
        for (l, r), y in ys.items():
            rows_out[l][y] = 1.0
            rows_in[r][y] = 1.0
        for rows, by in ((rows_out, by_out), (rows_in, by_in)):
            for layout, xs in by.items():
                terms = rows[layout]
                for x in xs:
                    terms[x] = terms.get(x, 0.0) - 1.0
                model.row(0.0, 0.0, terms)
    for e in problem.folded:
        d, s = dec[e.dst], dec[e.src]
        meta = graph.meta(Ref(e.src, e.index))
        held = _Held([(e.src, order[e.src], _edge_time(problem, e), _edge_end(problem, e),
                       _orig_end(problem, e))], points, {(e.src, e.index)} & early, e.index)
        same = s.group == d.group
        for i, c in enumerate(d.choices):
            r = c.inputs[e.pos]
            l = s.choices[i].outputs[e.index] if same else None
            if l is None:
                if c.comm_s > 0 and _edge_time(problem, e) in held.points:
                    transients[_edge_time(problem, e)][xvar[d.group][i]] += (
                        meta.nbytes / layout_fraction(r, mesh.sizes))
                continue
            for when, b in held.bytes(meta, l, r, mesh.sizes).items():
                transients[when][xvar[d.group][i]] += b
    return transients


class _Held:
    """The memory one block of edges (one value's readers in one consumer group, for every
    value of a producer group) holds at the constrained liveness points beyond the producers'
    own live ranges, for a given layout change ``l -> r``:

    * a change's result (a copy) is held from its first reader in the block to its last (the
      lowering frees a copy after its last reader, ``backends/_early.py``);
    * where the lowering reduces early (``l`` has a partial axis, the change shrinks the
      piece or is an all-reduce, which a bucket starts where the value is made: ``held_once``;
      the value is in ``Problem.early_values``), the reduced copy lives from where the value
      is made to its last reader, and the producer's own live range counts the partial
      original only where it is made (``_memory_terms``);
    * so an early value whose reader keeps it partial (or changes it without shrinking it)
      holds the original from where it is made to that reader.

    ``spans``: (producer, where it is made, where the consumer runs, until when the
    consumer holds what it reads: later for a view, ``_edge_end``; the same for a partial
    original read as it is, ``_orig_end``) per edge."""

    def __init__(self, spans: list[tuple[str, int, int, int, int]], points: list[int],
                 early: set[tuple[str, int]], index: int) -> None:
        self.points = set(points)
        # producer -> made, first reader, last reader, last point a reader holds it (a view),
        # and holds its partial original
        reads: dict[str, tuple[int, int, int, int, int]] = {}
        for n, start, when, end, orig in spans:
            _, a, b, c, d = reads.get(n, (start, when, when, end, orig))
            reads[n] = (start, min(a, when), max(b, when), max(c, end), max(d, orig))
        self.copy: dict[int, int] = defaultdict(int)    # point -> copies alive there
        self.plain: dict[int, int] = defaultdict(int)   # the same, of values not reduced early
        self.made: dict[int, int] = defaultdict(int)    # early values made by then, alive
        # early originals strictly after being made: until the last reader (``after``; the
        # readers read a copy), or as long as a reader holds them (``kept``: read as they are)
        self.after: dict[int, int] = defaultdict(int)
        self.kept: dict[int, int] = defaultdict(int)
        for n, (start, first, last, held, orig) in reads.items():
            is_early = (n, index) in early
            for t in self.points:
                if first <= t <= held:
                    self.copy[t] += 1
                    if not is_early:
                        self.plain[t] += 1
                if is_early and start <= t <= held:
                    self.made[t] += 1
                    if start < t <= orig:
                        self.kept[t] += 1
                    if start < t <= last:
                        self.after[t] += 1

    def bytes(self, meta: TensorMeta, l: Layout, r: Layout | None,
              sizes: tuple[int, ...]) -> dict[int, float]:
        out: dict[int, float] = defaultdict(float)
        if r is None or not (self.copy or self.made):
            return out                  # held at no constrained point
        copy = meta.nbytes / layout_fraction(r, sizes)
        if has_partial(l) and self.made:
            if held_once(l, r, sizes):
                for held in (self.made, self.plain):
                    for t, n in held.items():
                        out[t] += n * copy
                return out
            whole = meta.nbytes / layout_fraction(l, sizes)
            for t, n in (self.kept if l == r else self.after).items():
                out[t] += n * whole
        if l != r:
            for t, n in self.copy.items():
                out[t] += n * copy
        return out


def _edge_time(problem: Problem, e: Edge) -> int:
    """When a layout change's buffer is live: as its consumer runs (a state's write-back:
    as its producer finishes)."""
    order = problem.order
    return order[e.src] if e.pos == STATE_POS else order[e.dst]


def _edge_end(problem: Problem, e: Edge) -> int:
    """Until when a layout change's buffer is live: ``_edge_time``, or for a view's, as long
    as the view's readers run (the view shares it: ``Problem.view_ends``)."""
    if e.pos == STATE_POS:
        return problem.order[e.src]
    return problem.view_ends.get(e.dst, problem.order[e.dst])


def _orig_end(problem: Problem, e: Edge) -> int:
    """Until when the partial original of an early value read as it is lives for ``e``'s
    reader: ``_edge_end``, but for a view of it that is itself an early value (the
    transposed weight gradient a linear layer's backward makes) the view's own readers
    count from the view on, as its alias (``Problem.aliases``; one storage, counted once):
    one that changes it where it is made (``held_once``) ends the original there, as the
    lowering drops it."""
    if e.pos != STATE_POS and e.dst in problem.view_ends and (e.dst, 0) in problem.early_values:
        return _edge_time(problem, e) - 1
    return _edge_end(problem, e)


def _gathered(l: Layout, r: Layout) -> bool:
    """``r`` is ``l`` with some axes made Replicate (all-gathers / all-reduces only)."""
    return all(b == a or isinstance(b, type(R)) for a, b in zip(l, r))


@functools.lru_cache(maxsize=65536)
def candidate_pairs(outs: tuple[Layout, ...], ins: tuple[Layout, ...],
                    follower: bool) -> list[tuple[Layout, Layout]]:
    """Which (producer layout, consumer layout) changes an edge may make.

    Every pair is exact-costed, but not every pair is offered: keeping a layout, gathering some
    axes back to Replicate, slicing a replicated value (free), and changing ONE axis (a
    reduce-scatter or an all-to-all) cover data, FSDP, tensor and sequence parallelism; changes
    on several axes at once that are not pure gathers (e.g. swapping which axes shard which
    dims) are left out, and so is any change on the input of a free op (a view or transpose:
    the same change costs the same before or after it). This keeps the ILP near-linear in the
    number of layouts instead of quadratic.
    """
    in_set = set(ins)
    pairs: set[tuple[Layout, Layout]] = set()
    for l in outs:
        if l in in_set:
            pairs.add((l, l))
        for r in ins:
            if any(isinstance(b, Partial) and isinstance(a, Shard) for a, b in zip(l, r)):
                continue                      # a shard cannot become a partial sum
            if _gathered(l, r) or _gathered(r, l):
                pairs.add((l, r))
            elif not follower and sum(a != b for a, b in zip(l, r)) == 1:
                pairs.add((l, r))
    return sorted(pairs, key=str)


def _result_costs(problem: Problem, model: _Model, xvar: dict[int, list[int]]) -> None:
    """Results return to the controller replicated."""
    dec, mesh = problem.decisions, problem.mesh
    rep = tuple(R for _ in mesh.sizes)
    for ref in result_refs(problem.graph):
        if ref.node not in dec:
            continue
        meta = problem.graph.meta(ref)
        g = dec[ref.node].group
        for i, c in enumerate(dec[ref.node].choices):
            model.cost[xvar[g][i]] += reshard_time(meta, c.outputs[ref.index], rep, mesh)


# ---- memory --------------------------------------------------------------------------------

def _whole_profile(problem: Problem) -> list[float]:
    """Bytes live at each point with every value whole (unsharded)."""
    return _profile(problem, lambda name, idx: _value_bytes(problem, name, idx, None))


def _memory_points(prof: list[float], k: int) -> list[int]:
    """Liveness points to constrain: the peaks of the unsharded profile ``prof``."""
    order = sorted(range(len(prof)), key=lambda t: -prof[t])
    chosen: list[int] = []
    gap = max(1, len(prof) // (4 * k))
    for t in order:
        if all(abs(t - c) >= gap for c in chosen):
            chosen.append(t)
        if len(chosen) == k:
            break
    return chosen


def _value_bytes(problem: Problem, name: str, idx: int, layout: Layout | None) -> float:
    meta = problem.graph.node(name).outputs[idx]
    assert isinstance(meta, TensorMeta)
    if layout is None:
        return float(meta.nbytes)
    return meta.nbytes / layout_fraction(layout, problem.mesh.sizes)


def _profile(problem: Problem, size, cut=None) -> list[float]:  # noqa: ANN001
    """Bytes live at each point, each value of ``size(name, idx)`` bytes from where it is made
    to its last reader (only where it is made when ``cut(name, idx)``)."""
    n = len(problem.graph.nodes) + 1
    delta = [0.0] * (n + 1)
    for start, end, name, idx in problem.live_ranges:
        b = size(name, idx)
        if cut is not None and cut(name, idx):
            end = start
        delta[start] += b
        delta[end + 1 if end + 1 <= n else n] -= b
    return np.cumsum(delta[:n]).tolist()      # (adds in order, as a running sum does)


def _memory_terms(problem: Problem, xvar: dict[int, list[int]], t: int,
                  live: list[tuple[int, int, str, int]],
                  transients: dict[int, dict[int, float]]) -> dict[int, float]:
    dec = problem.decisions
    early = problem.early_values
    terms: dict[int, float] = defaultdict(float)
    for var, held in transients.get(t, {}).items():
        terms[var] += held
    for start, end, name, idx in live:
        if not start <= t <= end:
            continue
        d = dec[name]
        cut = t > start and (name, idx) in early     # a partial original lives on only as
        for i, c in enumerate(d.choices):            # its readers need it (_Held)
            if not (cut and has_partial(c.outputs[idx])):
                terms[xvar[d.group][i]] += _value_bytes(problem, name, idx, c.outputs[idx])
    return terms


def peak_memory(problem: Problem, choice: dict[str, int]) -> tuple[int, int]:
    """(peak bytes per rank, the liveness point where it happens) under ``choice``: each value
    from where it is made to its last reader, in its producer's layout; each layout change's
    result from its first reader to its last, once for the forward's readers and once for
    the later ones (``backends/_lower.py``); where the lowering reduces a partial value early
    (``backends/_early.py``), the original only until the last reader that needs it unreduced
    and the reduced copy from where the value is made to its last reader."""
    dec = problem.decisions
    mesh = problem.mesh
    early = problem.early_values

    def layout_of(name: str, idx: int) -> Layout:
        return dec[name].choices[choice[name]].outputs[idx]

    def is_early(name: str, idx: int) -> bool:
        return (name, idx) in early and has_partial(layout_of(name, idx))

    prof = _profile(problem, lambda name, idx: _value_bytes(problem, name, idx,
                                                            layout_of(name, idx)),
                    cut=is_early)
    n = len(prof)
    order = problem.order
    graph = problem.graph
    aliases = problem.aliases
    # a copy (value, layout, for the forward?) or an early original (layout None): held from
    # .. to (a copy serves the forward's readers or the later ones: backends._lower)
    spans: dict[tuple[str, int, Layout | None, bool], tuple[int, int]] = {}
    for e in problem.all_edges() + problem.folded:
        src = layout_of(e.src, e.index)
        dst = dec[e.dst].choices[choice[e.dst]].required(e.pos)
        if dst is None:
            continue
        when, end = _edge_time(problem, e), _edge_end(problem, e)
        forward = e.pos != STATE_POS and graph.node(e.dst).phase is Phase.FORWARD
        held = []                                # (what, from, until)
        if is_early(e.src, e.index) and held_once(src, dst, mesh.sizes):
            held.append(((e.src, e.index, dst, False), order[e.src], end))  # reduced where made
        else:
            if is_early(e.src, e.index):        # the original, until this reader (a view of
                root = aliases.get((e.src, e.index), (e.src, e.index))    # it: its readers;
                held.append(((*root, None, False), order[root[0]] + 1,    # a view's is its
                             _orig_end(problem, e) if src == dst else when))  # source's)
            if src != dst:
                held.append(((e.src, e.index, dst, forward), when, end))
        for key, start, until in held:
            a, b = spans.get(key, (start, until))
            spans[key] = (min(a, start), max(b, until))
    # (the sizes are whole bytes, so float64 sums them exactly in any order)
    delta = np.zeros(n + 1)
    for (name, idx, layout, _), (a, b) in spans.items():
        b = min(b, n - 1)
        if a <= b:
            size = _value_bytes(problem, name, idx, layout if layout is not None
                                else layout_of(name, idx))
            delta[a] += size
            delta[b + 1] -= size
    total = np.asarray(prof, dtype=np.float64) + np.cumsum(delta[:n])
    t = int(np.argmax(total))
    return int(total[t]), t
