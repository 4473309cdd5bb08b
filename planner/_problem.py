"""The planning problem: for every node, the N-axis strategies it may run with and what each
costs; for every edge, what changing layouts costs; which nodes repeat (layers) and so share
one decision.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import re
from dataclasses import dataclass, field

from .._errors import PlanError
from ..ir import (
    Graph, Node, NodeKind, OutputKind, Phase, Ref, Role, TensorMeta, node_bytes,
)
from ..ir._ops import view_source
from ..ir._types import DTYPE_BYTES
from ._comm import Collective, collective_time, transition
from ._kernel_cost import Work, kernel_work, node_work_of
from ._mesh import Mesh
from ._placement import (
    Layout, Partial, Placement, R, ReduceOp, Replicate, Shard, divides, format_layout,
    layout_fraction,
)
from .rules import OpStrategy, rule_for, strategies_for

INF = float("inf")


@dataclass(frozen=True, slots=True)
class Choice:
    """One way to run a node on the whole mesh: a layout per input Ref and per output."""

    inputs: tuple[Layout | None, ...]
    outputs: tuple[Layout | None, ...]
    compute_s: float
    comm_s: float = 0.0        # a layout change folded into this choice (see _fold_followers)

    def required(self, pos: int) -> Layout | None:
        """The layout this choice needs for its ``pos``-th Ref; ``STATE_POS`` names the layout
        of the input node itself (what a state's new value must be written back as)."""
        return self.outputs[0] if pos == STATE_POS else self.inputs[pos]


@dataclass
class Decision:
    """The choices of one node. ``cls``: nodes of one class are the same computation (other
    layers); ``group``: the variables the choice is read from. A group's members have aligned
    choice lists: choice ``i`` of every member is taken together."""

    node: str
    choices: list[Choice]
    cls: int = -1
    group: int = -1


STATE_POS = -1


@dataclass(frozen=True, slots=True)
class Edge:
    """Consumer ``dst`` reads output ``index`` of ``src`` as its ``pos``-th Ref. A state edge
    (``pos == STATE_POS``) carries a state's new value back to its input node ``dst``: the next
    step reads it in the input's layout."""

    src: str
    index: int
    dst: str
    pos: int


@dataclass
class Problem:
    graph: Graph
    mesh: Mesh
    decisions: dict[str, Decision]
    edges: list[Edge]
    fallbacks: list[str]                 # op targets without a sharding rule (run replicated)
    groups: list[list[str]] = field(default_factory=list)
    folded: list[Edge] = field(default_factory=list)   # edges into followers (no variables)
    # a hand-written family's collectives (DDP: the gradient all-reduce); a layout change that
    # needs another costs the solver a penalty, so it is chosen only where nothing else works
    collectives: frozenset[Collective] | None = None

    @functools.cached_property
    def order(self) -> dict[str, int]:
        return {n.name: i for i, n in enumerate(self.graph.nodes)}

    @functools.cached_property
    def live_ranges(self) -> list[tuple[int, int, str, int]]:
        """(start, end, producer, output index) of every tensor value a rank holds; persistent
        state lives through the whole step; a state's new value is written in place of the
        old one. A view holds no memory of its own: it keeps the value it aliases (through
        views of views) alive until its own last reader (``aliases``)."""
        graph = self.graph
        end = len(graph.nodes)
        last = dict(self.last_reads)
        in_place = {(ref.node, ref.index) for _, ref in state_pairs(graph)}
        base = self.aliases
        for view, root in base.items():             # graph order: a view after its source
            if view in last:
                last[root] = max(last.get(root, 0), last[view])
        out = []
        for i, n in enumerate(graph.nodes):
            if n.name not in self.decisions:
                continue
            if persistent(n):
                out.append((0, end, n.name, 0))
                continue
            for k, m in enumerate(n.outputs):
                if (isinstance(m, TensorMeta) and (n.name, k) not in in_place
                        and (n.name, k) not in base):
                    out.append((i, last.get((n.name, k), i), n.name, k))
        return out

    @functools.cached_property
    def last_reads(self) -> dict[tuple[str, int], int]:
        """(producer, output index) -> the position of its last reader; the step's outputs
        are read after the last node."""
        graph = self.graph
        last: dict[tuple[str, int], int] = {}
        for i, n in enumerate(graph.nodes):
            for r in n.refs():
                last[(r.node, r.index)] = i
        for o in graph.outputs:
            last[(o.ref.node, o.ref.index)] = len(graph.nodes)
        return last

    @functools.cached_property
    def view_ends(self) -> dict[str, int]:
        """View op -> the last point where its result, or a view of it, is read: what the
        view reads stays alive until then."""
        graph, order, last = self.graph, self.order, self.last_reads
        out: dict[str, int] = {}
        for view in sorted(self._view_source, key=order.__getitem__, reverse=True):
            n = graph.node(view)
            out[view] = max([out.get(view, order[view])]
                            + [last.get((view, k), 0) for k in range(len(n.outputs))])
            parent = self._view_source[view][0]
            if parent in self._view_source:         # a view of a view keeps both alive
                out[parent] = max(out.get(parent, order[parent]), out[view])
        return out

    @functools.cached_property
    def aliases(self) -> dict[tuple[str, int], tuple[str, int]]:
        """(view, output index) -> the (producer, output index) whose storage it shares,
        through views of views, for every view op on a tensor. The lowering runs views as
        views, so the storage is that value's piece where the layouts agree; where the planner
        changes the value's layout for the view, the view shares the changed copy, which
        ``view_ends`` keeps alive as long as the view."""
        graph = self.graph
        out: dict[tuple[str, int], tuple[str, int]] = {}
        for view, src in self._view_source.items():     # graph order: a source before its views
            for k, m in enumerate(graph.node(view).outputs):   # split / unbind: every piece
                if isinstance(m, TensorMeta):
                    out[(view, k)] = out.get(src, src)
        return out

    @functools.cached_property
    def _view_source(self) -> dict[str, tuple[str, int]]:
        """View op -> the (producer, output index) of the tensor it views, in graph order."""
        graph = self.graph
        out: dict[str, tuple[str, int]] = {}
        for n in graph.nodes:
            if n.kind is not NodeKind.OP or n.name not in self.decisions:
                continue
            i = view_source(n.target)
            if (i is not None and i < len(n.args) and isinstance(n.args[i], Ref)
                    and isinstance(graph.meta(n.args[i]), TensorMeta)):
                out[n.name] = (n.args[i].node, n.args[i].index)
        return out

    @functools.cached_property
    def early_values(self) -> frozenset[tuple[str, int]]:
        """(producer, output index) of the floating-point values the lowering may reduce where
        they are made and drop (``backends/_early.py``): every one the step does not return
        or write back as state (those are read in their own layout after the last op)."""
        graph = self.graph
        kept = {(o.ref.node, o.ref.index) for o in graph.outputs}
        return frozenset(
            (n.name, k) for n in graph.nodes if n.name in self.decisions
            for k, m in enumerate(n.outputs)
            if isinstance(m, TensorMeta) and (n.name, k) not in kept
            and m.dtype.startswith(("float", "bfloat")))

    def is_follower(self, name: str) -> bool:
        known = self._followers.get(name)
        if known is None:
            known = self._followers[name] = is_follower(self.graph, self.graph.node(name))
        return known

    @functools.cached_property
    def _followers(self) -> dict[str, bool]:
        return {}

    def state_edges(self) -> list[Edge]:
        return [Edge(ref.node, ref.index, inp, STATE_POS) for inp, ref in state_pairs(self.graph)
                if ref.node != inp and ref.node in self.decisions]

    def all_edges(self) -> list[Edge]:
        return self.edges + self.state_edges()


# ---- strategies -------------------------------------------------------------------------------

def is_follower(graph: Graph, node: Node) -> bool:
    """A free op (a view: no FLOPs, no bytes) reading exactly one tensor."""
    if node.kind is not NodeKind.OP:
        return False
    tensors = [r for r in node.refs() if isinstance(graph.meta(r), TensorMeta)]
    return len(tensors) == 1 and node_bytes(graph, node) == 0


def _input_layouts(meta: TensorMeta, mesh: Mesh) -> list[Layout]:
    per_axis: list[Placement] = [R] + [Shard(d) for d in range(len(meta.shape)) if meta.shape[d] > 1]
    out = []
    for layout in itertools.product(per_axis, repeat=len(mesh.sizes)):
        if divides(meta.shape, layout, mesh.sizes):
            out.append(tuple(layout))
    return out


def _fits(metas: tuple[TensorMeta | None, ...], layouts: tuple[Layout | None, ...],
          sizes: tuple[int, ...]) -> bool:
    return all(m is None or divides(m.shape, l, sizes) for m, l in zip(metas, layouts))


def _op_choices(graph: Graph, node: Node, mesh: Mesh,
                kernels: dict[str, Work]) -> tuple[list[Choice], bool]:
    one_axis, has_rule = strategies_for(node, graph)
    ins = [graph.meta(r) for r in node.refs()]
    in_metas = tuple(m if isinstance(m, TensorMeta) else None for m in ins)
    out_metas = tuple(m if isinstance(m, TensorMeta) else None for m in node.outputs)
    flops, nbytes, target, floor = node_work_of(graph, node, kernels)  # a kernel's share?
    topo = mesh.topology
    dtype = next((m.dtype for m in out_metas if m is not None), "float32")
    base = one_axis[0]
    choices: list[Choice] = []
    for combo in itertools.product(one_axis, repeat=len(mesh.sizes)):
        inputs = _zip_layouts([s.inputs for s in combo])
        outputs = _zip_layouts([s.outputs for s in combo])
        if not (_fits(in_metas, inputs, mesh.sizes) and _fits(out_metas, outputs, mesh.sizes)):
            continue
        split = 1
        for s, n in zip(combo, mesh.sizes):
            if s != base:
                split *= n
        choices.append(Choice(inputs, outputs,
                              _compute_time(flops, nbytes, split, dtype, topo, target,
                                            floor=floor)))
    return choices, has_rule


def _zip_layouts(per_axis: list[tuple[Placement | None, ...]]) -> tuple[Layout | None, ...]:
    return tuple(None if ps[0] is None else tuple(ps) for ps in zip(*per_axis))


def _compute_time(flops: float, nbytes: float, split: int, dtype: str, topo,  # noqa: ANN001
                  target: str | None = None, floor: bool = True) -> float:
    """The roofline time of one rank's share of an op (at least the kernel floor, unless
    ``floor`` is False: a fused kernel's member other than its anchor), times the op's
    calibrated factor (``Topology.op_factors``; 1 unless a run was fitted)."""
    if flops == 0 and nbytes == 0:
        return 0.0
    eff = topo.compute_efficiency
    t = max(flops / split / (topo.flops_for(dtype) * eff),
            nbytes / split / (topo.memory_bandwidth * eff))
    if floor:
        t = max(t, topo.kernel_floor_s)
    return t * topo.op_factor(target) if target is not None else t


# ---- communication ---------------------------------------------------------------------------

def reshard_steps(meta: TensorMeta, src: Layout, dst: Layout,
                  mesh: Mesh) -> list[tuple[Collective, int, float, float]] | None:
    """The collectives (kind, mesh axis, bytes, seconds) that turn ``src`` into ``dst``, axis by
    axis; None if the change is impossible (e.g. Shard -> Partial)."""
    steps = []
    cur = list(src)
    for axis, (a, b) in enumerate(zip(src, dst)):
        if a == b:
            continue
        kind = transition(a, b)
        if kind is False:
            return None
        if kind is not None:
            # the buffer the collective works on: the value with this axis replicated (the
            # all-gather's output, the all-reduce's and reduce-scatter's input), except for an
            # all-to-all, which exchanges the pieces of its local shard
            held = tuple(cur) if kind is Collective.ALL_TO_ALL else tuple(
                p if i != axis else R for i, p in enumerate(cur))
            nbytes = meta.nbytes / layout_fraction(held, mesh.sizes)
            t = collective_time(kind, nbytes, mesh.sizes[axis], mesh.link(axis))
            steps.append((kind, axis, nbytes, t))
        cur[axis] = b
    return steps


_LOW_FLOATS = ("bfloat16", "float16")
# ops that only lay their input out anew: a partial sum passes them unchanged
_SAME_VALUES = frozenset({
    "aten.t.default", "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
    "aten.permute.default", "aten.transpose.int", "aten.clone.default", "aten.alias.default",
    "aten.contiguous.default", "aten.squeeze.dim", "aten.squeeze.dims", "aten.unsqueeze.default",
    "aten.detach.default",
})


def reduce_wide(graph: Graph) -> frozenset[tuple[str, int]]:
    """The 16-bit float values (node, output) that reach a cast to a wider float through ops
    that only lay them out anew: a gradient under autocast (a bf16 matmul's weight gradient,
    transposed, cast to the fp32 parameter's). A partial sum on them must pass the cast and be
    reduced in the wider dtype, as one process accumulates it and as DDP reduces fp32
    ``.grad``; reducing the 16-bit terms would round every partial sum to 8 (bf16) or 11
    (fp16) significant bits (the solver forbids it: ``reduces``)."""
    producers = {n.name: n for n in graph.nodes}
    out: set[tuple[str, int]] = set()
    for node in graph.nodes:
        ref = next(iter(node.refs()), None)
        if node.target != "aten._to_copy.default" or ref is None:
            continue
        dst = node.outputs[0]
        while True:
            src = graph.meta(ref)
            if not (isinstance(src, TensorMeta) and isinstance(dst, TensorMeta)
                    and src.dtype in _LOW_FLOATS and dst.dtype.startswith("float")
                    and DTYPE_BYTES[dst.dtype] > DTYPE_BYTES[src.dtype]):
                break
            out.add((ref.node, ref.index))
            prev = producers.get(ref.node)
            up = next(iter(prev.refs()), None) if prev is not None else None
            if up is None or prev.target not in _SAME_VALUES:
                break
            ref = up
    return frozenset(out)


def reduces(src: Layout, dst: Layout) -> bool:
    """Does changing ``src`` into ``dst`` sum partial values (on some axis)?"""
    return any(isinstance(a, Partial) and not isinstance(b, Partial) for a, b in zip(src, dst))


def shrinks(src: Layout, dst: Layout, sizes: tuple[int, ...]) -> bool:
    """Does changing ``src`` into ``dst`` sum a partial axis and leave each rank a smaller
    piece (a reduce-scatter, not an all-reduce)? The lowering makes such a change where the
    value is made (``backends/_early.py``)."""
    return reduces(src, dst) and layout_fraction(dst, sizes) > layout_fraction(src, sizes)


def all_reduces(src: Layout, dst: Layout) -> bool:
    """Is changing ``src`` into ``dst`` an all-reduce only (partial sums or averages made
    whole, nothing else moved)? The lowering merges such changes into buckets, started where
    the value is made: the bucket's buffer holds the value from there, the original is
    dropped (``backends/_bucket.py``, ``backends/_early.py``)."""
    changed = False
    for a, b in zip(src, dst):
        if a == b:
            continue
        if not (isinstance(a, Partial) and a.op in (ReduceOp.SUM, ReduceOp.AVG)
                and isinstance(b, Replicate)):
            return False
        changed = True
    return changed


def held_once(src: Layout, dst: Layout, sizes: tuple[int, ...]) -> bool:
    """Does the lowering hold a partial value changed ``src`` -> ``dst`` once, reduced from
    where it is made to its last reader (a reduce-scatter moved there, or an all-reduce in a
    bucket started there), rather than the original up to the change and the copy after?"""
    return shrinks(src, dst, sizes) or all_reduces(src, dst)


def has_partial(layout: Layout | None) -> bool:
    return layout is not None and any(isinstance(p, Partial) for p in layout)


def reshard_time(meta: TensorMeta, src: Layout, dst: Layout, mesh: Mesh) -> float:
    """Seconds to turn a value laid out ``src`` into ``dst``; INF if impossible."""
    if src == dst:
        return 0.0
    steps = reshard_steps(meta, src, dst, mesh)
    return INF if steps is None else sum(s[3] for s in steps)


# ---- building ----------------------------------------------------------------------------------

def build_problem(graph: Graph, mesh: Mesh, pins: dict[str, set[Layout]] | None = None,
                  reads: dict[str, Layout] | None = None,
                  update_reads: dict[str, Layout] | None = None) -> Problem:
    """All decisions and edges of ``graph`` on ``mesh``. ``pins`` restricts the layouts of the
    named input nodes (state names, e.g. ``"x"`` or ``"model.fc.weight"``); ``reads`` fixes the
    layout in which forward and backward ops read a named input (a hand-written family's
    compute pattern: FSDP gathers every weight before it is used); ``update_reads`` the layout
    in which the optimizer's update ops read a named state input (the families update state
    where it lives: DDP replicated, FSDP on its shards)."""
    pins = pins or {}
    decisions: dict[str, Decision] = {}
    fallbacks: list[str] = []
    hashes = wl_hashes(graph)
    kernels = kernel_work(graph, mesh.topology)
    # nodes of one hash and one share of a fused kernel (inputs: of one layout set) share
    # their Choice objects
    seen: dict[tuple[str, Work | None], tuple[list[Choice], bool]] = {}
    input_choices: dict[tuple[Layout, ...], list[Choice]] = {}
    for node in graph.nodes:
        key = (hashes[node.name], kernels.get(node.name)) if node.kind is NodeKind.OP else None
        if node.kind is NodeKind.OP and key in seen:
            choices, has_rule = seen[key]
            if not has_rule:
                fallbacks.append(node.target)
            decisions[node.name] = Decision(node.name, list(choices))
        elif node.kind is NodeKind.INPUT:
            layouts = _input_layouts(node.meta, mesh)
            if node.target in pins:
                layouts = [l for l in layouts if l in pins[node.target]]
                if not layouts:
                    raise PlanError(f"no allowed layout of input {node.target!r} "
                                    f"{node.meta.dtype}{list(node.meta.shape)} divides on mesh "
                                    f"{mesh}; pick a layout whose sharded dims divide evenly")
            key = tuple(layouts)
            if key not in input_choices:
                input_choices[key] = [Choice((), (l,), 0.0) for l in layouts]
            decisions[node.name] = Decision(node.name, list(input_choices[key]))
        elif node.kind is NodeKind.CONSTANT:
            rep = tuple(R for _ in mesh.sizes)
            key = (rep,)
            if key not in input_choices:
                input_choices[key] = [Choice((), key, 0.0)]
            decisions[node.name] = Decision(node.name, list(input_choices[key]))
        elif node.kind is NodeKind.OP:
            choices, has_rule = _op_choices(graph, node, mesh, kernels)
            seen[key] = (choices, has_rule)
            if not has_rule:
                fallbacks.append(node.target)
            if not choices:
                raise PlanError(f"node {node.name} ({node.target}) has no layout that divides "
                                f"on mesh {mesh}")
            decisions[node.name] = Decision(node.name, choices)
    forced = _apply_reads(graph, decisions, reads or {})
    _apply_update_reads(graph, decisions, update_reads or {})
    _prune_partial_inputs(graph, decisions)
    edges = []
    for node in graph.nodes:
        if node.name not in decisions:
            continue
        for pos, r in enumerate(node.refs()):
            if r.node in decisions and isinstance(graph.meta(r), TensorMeta):
                edges.append(Edge(r.node, r.index, node.name, pos))
    problem = Problem(graph, mesh, decisions, edges, sorted(set(fallbacks)))
    problem.groups = _share(graph, decisions, hashes)
    _fold_followers(problem, forced)
    return problem


def _apply_reads(graph: Graph, decisions: dict[str, Decision],
                 reads: dict[str, Layout]) -> dict[str, Layout]:
    """Restrict forward/backward readers of the inputs named in ``reads`` to that layout.
    Returns the followers (views) that must read it, which ``_fold_followers`` honours. A cast
    of such an input to a narrower dtype (mixed precision's compute copy) is left free, and its
    readers are restricted instead: FSDP2 casts the shard and gathers the 16-bit copy."""
    if not reads:
        return {}
    names = {n.name: reads[n.target] for n in graph.inputs if n.target in reads}
    forced: dict[str, Layout] = {}
    for node in graph.nodes:
        if node.kind is not NodeKind.OP or node.phase is Phase.UPDATE:
            continue
        for pos, r in enumerate(node.refs()):
            want = names.get(r.node)
            if want is None:
                continue
            if node.target == "aten._to_copy.default" and _narrows(graph, node):
                names[node.name] = want
                continue
            if is_follower(graph, node):
                forced[node.name] = want
                continue
            d = decisions[node.name]
            kept = [c for c in d.choices if c.inputs[pos] == want]
            if not kept:  # no rule reads that shard (e.g. vocab-parallel embedding): gather
                rep = tuple(R for _ in want)
                kept = [c for c in d.choices if c.inputs[pos] == rep]
            if not kept:
                raise PlanError(f"{node.target} at {node.source or node.name} cannot read "
                                f"{graph.node(r.node).target} as {format_layout(want)}")
            d.choices = kept
    return forced


def _narrows(graph: Graph, node: Node) -> bool:
    """A cast whose tensor output is narrower than its tensor input (fp32 -> bf16)."""
    src, out = graph.meta(next(node.refs())), node.outputs[0]
    return (isinstance(src, TensorMeta) and isinstance(out, TensorMeta)
            and DTYPE_BYTES.get(out.dtype, 0) < DTYPE_BYTES.get(src.dtype, 0))


def _apply_update_reads(graph: Graph, decisions: dict[str, Decision],
                        reads: dict[str, Layout]) -> None:
    """Restrict the update phase's readers of the state inputs named in ``reads`` to read them
    in that layout, and the update ops that write those states' new values to write them in it
    (a node with no such choice keeps its choices)."""
    names = {n.name: reads[n.target] for n in graph.inputs if n.target in reads}
    if not names:
        return
    for out in graph.outputs:
        if out.kind is not OutputKind.STATE or out.name not in reads:
            continue
        node = graph.node(out.ref.node)
        if node.kind is NodeKind.OP and node.phase is Phase.UPDATE:
            d = decisions[node.name]
            kept = [c for c in d.choices if c.outputs[out.ref.index] == reads[out.name]]
            if kept:
                d.choices = kept
    for node in graph.nodes:
        if node.kind is not NodeKind.OP or node.phase is not Phase.UPDATE:
            continue
        d = decisions[node.name]
        for pos, r in enumerate(node.refs()):
            want = names.get(r.node)
            if want is None:
                continue
            kept = [c for c in d.choices if c.inputs[pos] == want]
            if kept:
                d.choices = kept


def _fold_followers(problem: Problem, forced: dict[str, Layout] | None = None) -> None:
    """Nodes whose choice their producer's choice decides share the producer's variables,
    and the edge between them leaves the ILP (Alpa's "follow" strategies):

    * a free op reading one tensor (a view, a transpose): its choice is the one that reads
      the producer's layout unchanged, or, if it cannot, its all-Replicate choice after
      gathering (cost folded into the choice);
    * an elementwise op read once (any op in the update phase, where every reader follows
      too) follows its first same-shaped operand made by an op, when for every layout of that
      operand exactly one of its choices reads it: a layout change on that edge would cost
      the same on its other, same-shaped operands or its output. Update ops never follow
      the backward or the state inputs, so a sharded optimizer update (ZeRO) stays open.
    """
    graph, mesh, dec = problem.graph, problem.mesh, problem.decisions
    rep = tuple(R for _ in mesh.sizes)
    readers: dict[str, int] = {}
    for e in problem.edges:
        readers[e.src] = readers.get(e.src, 0) + 1
    for o in graph.outputs:
        readers[o.ref.node] = readers.get(o.ref.node, 0) + 2
    folded: set[tuple[str, int]] = set()
    memo: dict[tuple, list[Choice] | None] = {}
    aligned_by: dict[tuple, list[Choice] | None] = {}
    for node in graph.nodes:
        if node.name not in dec:
            continue
        if not problem.is_follower(node.name):
            pos = _anchor(graph, node, dec)
            if pos is not None and (readers.get(node.name, 0) <= 1
                                    or node.phase is Phase.UPDATE):
                if _follow(graph, node, pos, dec, memo):
                    folded.add((node.name, pos))
            continue
        if readers.get(node.name, 0) != 1:
            # a view read twice keeps its own decision: gathering once at the view can beat
            # gathering at each reader, and only its own variables can express that
            want = (forced or {}).get(node.name)
            if want is not None:
                pos = next(i for i, r in enumerate(node.refs())
                           if isinstance(graph.meta(r), TensorMeta))
                dec[node.name].choices = [c for c in dec[node.name].choices
                                          if c.inputs[pos] == want]
            continue
        refs = list(node.refs())
        pos, ref = next((i, r) for i, r in enumerate(refs)
                        if isinstance(graph.meta(r), TensorMeta))
        if ref.node not in dec:
            continue
        f, p = dec[node.name], dec[ref.node]
        meta = graph.meta(ref)
        want = (forced or {}).get(node.name)
        # the same choices reading the same producer's (the layers') fold the same way
        key = (pos, ref.index, want, meta.nbytes, *map(id, f.choices), None,
               *map(id, p.choices))
        if key not in aligned_by:
            aligned_by[key] = _aligned(f, p, pos, ref.index, meta, want, rep, mesh)
        aligned = aligned_by[key]
        if aligned is None:
            continue
        f.choices = list(aligned)
        f.group = p.group
        folded.add((node.name, pos))
    problem.folded = [e for e in problem.edges if (e.dst, e.pos) in folded]
    problem.edges = [e for e in problem.edges if (e.dst, e.pos) not in folded]


def _aligned(f: Decision, p: Decision, pos: int, index: int, meta: TensorMeta,
             want: Layout | None, rep: Layout, mesh: Mesh) -> list[Choice] | None:
    """A view's choices aligned with its producer's (``_fold_followers``): per producer
    choice, the view's choice that reads its layout (``want`` only, where forced), else its
    all-Replicate choice with the change's cost; None where the view keeps its decision."""
    by_input: dict[Layout, Choice] = {}
    for c in f.choices:
        by_input.setdefault(c.inputs[pos], c)
    if len({(c.inputs[pos], c.outputs) for c in f.choices}) > len(by_input):
        # a view with a choice of its own for one input layout (``expand`` of a replicated
        # scalar to a split or a whole tensor: a mean's backward) keeps its decision: the
        # first choice per input would drop the split ones, and every op after it would
        # read the whole tensor (the gradient of ``loss + h.pow(2).mean()`` gathered ``h``)
        return None
    base = next(c for c in f.choices if all(l is None or l == rep for l in c.inputs))
    if want is not None and want in by_input:
        base = by_input[want]
    aligned = []
    for c in p.choices:
        layout = c.outputs[index]
        if layout in by_input and (want is None or layout == want):
            aligned.append(by_input[layout])
        else:
            aligned.append(Choice(base.inputs, base.outputs, base.compute_s,
                                  reshard_time(meta, layout, base.inputs[pos], mesh)))
    return aligned


def _anchor(graph: Graph, node: Node, dec: dict[str, Decision]) -> int | None:
    """The operand an elementwise op (one output) follows: the first tensor it reads with the
    output's shape made by an op with a decision (in the update phase: by an update op)."""
    if node.kind is not NodeKind.OP or len(node.outputs) != 1:
        return None
    rule = rule_for(node.target)
    out = node.outputs[0]
    if not isinstance(out, TensorMeta) or rule is None or rule.family != "pointwise":
        return None
    for pos, r in enumerate(node.refs()):
        m = graph.meta(r)
        src = graph.node(r.node)
        if (isinstance(m, TensorMeta) and m.shape == out.shape and r.node in dec
                and src.kind is NodeKind.OP
                and (node.phase is not Phase.UPDATE or src.phase is Phase.UPDATE)):
            return pos
    return None


def _follow(graph: Graph, node: Node, pos: int, dec: dict[str, Decision],
            memo: dict[tuple, list[Choice] | None]) -> bool:
    """Make ``node`` share the decision of the producer it reads at ``pos`` when it can run in
    every layout that producer may yield: then changing layouts on that edge is never needed
    (the same change costs the same on its other, same-shaped inputs or its output)."""
    ref = list(node.refs())[pos]
    f, p = dec[node.name], dec[ref.node]
    key = (tuple(map(id, f.choices)), pos, tuple(map(id, p.choices)), ref.index)
    if key not in memo:
        by_input: dict[Layout, list[Choice]] = {}
        for c in f.choices:
            by_input.setdefault(c.inputs[pos], []).append(c)
        aligned: list[Choice] | None = []
        for c in p.choices:
            hits = by_input.get(c.outputs[ref.index], [])
            if len(hits) != 1:     # none, or a choice the fold would have to make
                aligned = None
                break
            aligned.append(hits[0])
        memo[key] = aligned
    if memo[key] is None:
        return False
    f.choices = list(memo[key])
    f.group = p.group
    return True


def _prune_partial_inputs(graph: Graph, decisions: dict[str, Decision]) -> None:
    """Drop choices that make a Partial value out of nothing.

    Turning R into P is free (one rank keeps the value, the others hold zeros) and needed when
    a partial operand meets a replicated one (a row-parallel matmul's bias, a residual add of a
    partial sum). But a choice whose Partial inputs on an axis all come from producers that
    cannot yield Partial there, and whose other inputs are all Replicate on that axis, only
    fabricates a partial sum that must be reduced later: it is dominated by reading R. Walking
    in topological order lets the pruning cascade (most activations are never Partial). The
    all-Replicate choice always survives.
    """
    partial_axes: dict[tuple[str, int], frozenset[int]] = {}
    none: frozenset[int] = frozenset()
    kept: dict[tuple, list[Choice]] = {}   # layers share Choice objects: prune each once
    yields: dict[tuple, list[frozenset[int]]] = {}
    for node in graph.nodes:
        d = decisions.get(node.name)
        if d is None:
            continue
        if node.kind is NodeKind.OP:
            capable = tuple(partial_axes.get((r.node, r.index), none) for r in node.refs())
            key = (tuple(map(id, d.choices)), capable)
            if key not in kept:
                kept[key] = [c for c in d.choices if not _fabricates_partial(c, capable)]
            d.choices = list(kept[key])
        key = tuple(map(id, d.choices))
        if key not in yields:
            yields[key] = [_partial_axes({c.outputs[k] for c in d.choices if k < len(c.outputs)})
                           for k in range(len(node.outputs))]
        for k, axes in enumerate(yields[key]):
            partial_axes[(node.name, k)] = axes


def _partial_axes(layouts: set[Layout | None]) -> frozenset[int]:
    return frozenset(a for layout in layouts if layout is not None
                     for a, p in enumerate(layout) if isinstance(p, Partial))


def _fabricates_partial(c: Choice, capable: tuple[frozenset[int], ...]) -> bool:
    n_axes = next((len(l) for l in c.inputs if l is not None), 0)
    for a in range(n_axes):
        wants = [i for i, l in enumerate(c.inputs) if l is not None and isinstance(l[a], Partial)]
        if not wants or any(a in capable[i] for i in wants):
            continue
        others = [l[a] for i, l in enumerate(c.inputs) if l is not None and i not in wants]
        if all(p == R for p in others):
            return True
    return False


# ---- sharing repeated layers --------------------------------------------------------------------

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _normalize(path: str) -> str:
    """``model.h.3.attn`` -> ``model.h.#.attn``: layers of a ModuleList look alike."""
    return _INDEX.sub("#", path)


def _label(node: Node) -> str:
    outs = ";".join(f"{m.dtype}{m.shape}" if isinstance(m, TensorMeta) else str(m)
                    for m in node.outputs)
    if node.kind is NodeKind.INPUT:
        return f"in|{node.meta.role.value}|{_normalize(node.target)}|{outs}"
    if node.kind is NodeKind.CONSTANT:
        v = node.value
        digest = hashlib.sha1(v.data or b"").hexdigest() if v else ""
        return f"const|{outs}|{digest}"
    lits = repr(_literals(node.args)) + repr(_literals(tuple(v for _, v in node.kwargs)))
    return f"{node.kind.value}|{node.target}|{_normalize(node.module_path)}|{node.phase.value}|{outs}|{lits}"


def _literals(args: tuple) -> tuple:
    return tuple("@" if isinstance(a, Ref) else _literals(a) if isinstance(a, tuple) else a
                 for a in args)


def wl_hashes(graph: Graph, rounds: int = 4) -> dict[str, int]:
    """Weisfeiler-Lehman classes over ``rounds`` hops of inputs, with layer indices removed
    from names: the same computation in different layers gets the same class. A class is a
    small int naming one distinct (label, inputs' classes) in this call (exact: no hash
    collides)."""
    ids: dict = {}
    h = {n.name: ids.setdefault(_label(n), len(ids)) for n in graph.nodes}
    for _ in range(rounds):
        h = {n.name: ids.setdefault((h[n.name], tuple((h[r.node], r.index) for r in n.refs())),
                                    len(ids))
             for n in graph.nodes}
    return h


def _share(graph: Graph, decisions: dict[str, Decision], h: dict[str, str]) -> list[list[str]]:
    """Group nodes that are the same computation in different layers; nodes of a group must
    have the same choices; the group gets one decision."""
    by_hash: dict[tuple, list[str]] = {}
    for name, d in decisions.items():
        # nodes of one hash hold the same Choice objects (build_problem shares them)
        key = (h[name], tuple(map(id, d.choices)))
        by_hash.setdefault(key, []).append(name)
    groups = list(by_hash.values())
    for gi, members in enumerate(groups):
        for m in members:
            decisions[m].cls = decisions[m].group = gi
    return groups


def state_pairs(graph: Graph) -> list[tuple[str, Ref]]:
    """(input node name, ref of its new value) for every state the step updates."""
    inputs = {n.target: n.name for n in graph.inputs}
    out = []
    for o in graph.outputs:
        if o.kind is OutputKind.STATE and o.name in inputs:
            out.append((inputs[o.name], o.ref))
    return out


def result_refs(graph: Graph) -> list[Ref]:
    return [o.ref for o in graph.outputs if o.kind is OutputKind.RESULT]


def persistent(node: Node) -> bool:
    return node.kind is NodeKind.INPUT and node.meta.role in (
        Role.PARAM, Role.OPT_STATE, Role.BUFFER, Role.GRAD)


__all__ = ["Choice", "Decision", "Edge", "Problem", "build_problem", "reshard_time",
           "reshard_steps",
           "state_pairs", "result_refs", "persistent", "OpStrategy"]
