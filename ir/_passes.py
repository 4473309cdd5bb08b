"""Pure graph passes: ``Graph -> Graph``. Each keeps ``verify`` true."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ._graph import Graph, Node
from ._types import NodeKind, Ref

Pass = Callable[[Graph], Graph]

# Ops that return their input unchanged in a pure graph (no autograd, no mutation).
IDENTITY_OPS = frozenset({"aten.detach.default", "aten.alias.default"})


def _rewrite(a: Any, subst: dict[Ref, Ref]) -> Any:
    if isinstance(a, Ref):
        return subst.get(a, a)
    if isinstance(a, tuple):
        return tuple(_rewrite(x, subst) for x in a)
    return a


def rewrite_refs(node: Node, subst: dict[Ref, Ref], **changes: Any) -> Node:
    """``node`` reading ``subst[r]`` wherever it read a key ``r`` (and with ``changes``)."""
    return dataclasses.replace(node, args=_rewrite(node.args, subst),
                               kwargs=tuple((k, _rewrite(v, subst)) for k, v in node.kwargs),
                               **changes)


def substitute(graph: Graph, subst: dict[Ref, Ref], drop: set[str]) -> Graph:
    """Replace every read of a key of ``subst`` by its value and drop the nodes in ``drop``."""
    nodes = []
    for n in graph.nodes:
        if n.name in drop:
            continue
        if subst:
            n = rewrite_refs(n, subst)
        nodes.append(n)
    outputs = tuple(dataclasses.replace(o, ref=subst.get(o.ref, o.ref)) for o in graph.outputs)
    return Graph(tuple(nodes), outputs, graph.info)


def _identity_source(graph: Graph, n: Node) -> Ref | None:
    """The value ``n`` returns unchanged, if it is an identity: ``detach``/``alias`` of x, or
    ``copy(x, y)`` of same-shaped, same-dtype tensors (functionalised ``x.copy_(y)``: y)."""
    if n.kind is not NodeKind.OP:
        return None
    if n.target in IDENTITY_OPS and isinstance(n.args[0], Ref):
        return n.args[0]
    if n.target == "aten.copy.default" and len(n.args) >= 2 and not n.kwargs and all(
            isinstance(a, Ref) for a in n.args[:2]):
        dst, src = graph.meta(n.args[0]), graph.meta(n.args[1])
        if getattr(dst, "shape", None) == getattr(src, "shape", 0) and (
                getattr(dst, "dtype", None) == getattr(src, "dtype", 0)):
            return n.args[1]
    return None


def remove_identity_ops(graph: Graph) -> Graph:
    """Forward reads of identities (``detach``, ``alias``, a same-shape ``copy``) to their
    source; tracing leaves many behind."""
    subst: dict[Ref, Ref] = {}
    drop: set[str] = set()
    for n in graph.nodes:
        source = _identity_source(graph, n)
        if source is not None:
            src = subst.get(source, source)
            subst[Ref(n.name, 0)] = src
            drop.add(n.name)
    return substitute(graph, subst, drop)


def merge_host_scalars(graph: Graph) -> Graph:
    """One node for host arithmetic repeated on the same operands. An optimizer's per-parameter
    loop computes ``-lr`` or ``1 - lr * wd`` once per parameter; with the hyperparameter a
    graph input, each would be its own node, and updates that could share one kernel launch
    (the same scalars) would not see that they do. Those computed from hyperparameters alone
    then move right after the inputs."""
    subst: dict[Ref, Ref] = {}
    drop: set[str] = set()
    seen: dict[tuple, str] = {}
    for n in graph.nodes:
        if n.kind is not NodeKind.HOST:
            continue
        key = (n.target, _rewrite(n.args, subst),
               tuple((k, _rewrite(v, subst)) for k, v in n.kwargs), n.outputs)
        try:
            first = seen.setdefault(key, n.name)
        except TypeError:             # an unhashable literal: keep the node
            continue
        if first != n.name:
            subst[Ref(n.name, 0)] = Ref(first, 0)
            drop.add(n.name)
    merged = substitute(graph, subst, drop) if drop else graph
    return _hoist_hyper(merged)


def _hoist_hyper(graph: Graph) -> Graph:
    """Move the host scalars computed from hyperparameter inputs alone (``-lr``, ``1 - lr *
    wd``) to the start of the update phase: shared by every parameter's update, they belong
    to no layer (the block stamping in ``frontend/_stamp.py`` needs each layer's update
    nodes contiguous)."""
    from ._types import Phase, Role

    hyper: set[str] = set()
    for n in graph.nodes:
        if n.kind is NodeKind.INPUT:
            if n.meta.role is Role.HYPER:
                hyper.add(n.name)
        elif (n.kind is NodeKind.HOST or n.target == "aten._local_scalar_dense.default") and (
                refs := list(n.refs())) and all(r.node in hyper for r in refs):
            hyper.add(n.name)
    if not hyper:
        return graph
    lifted = [dataclasses.replace(n, phase=Phase.UPDATE) for n in graph.nodes
              if n.name in hyper and n.kind is not NodeKind.INPUT]
    rest = [n for n in graph.nodes if n.name not in hyper or n.kind is NodeKind.INPUT]
    at = next((i for i, n in enumerate(rest) if n.kind is not NodeKind.INPUT and (
        n.phase is Phase.UPDATE or any(r.node in hyper for r in n.refs()))), len(rest))
    return Graph(tuple(rest[:at] + lifted + rest[at:]), graph.outputs, graph.info)


def hoist_casts(graph: Graph) -> Graph:
    """Move each dtype cast of the backward (``_to_copy``) whose input nothing else reads to
    right after that input is made, as eager autograd runs it (a cast's backward runs as soon
    as its gradient exists). A traced step lists the casts of the parameters' gradients back
    to fp32 (mixed precision) after the whole backward, so every 16-bit gradient would live,
    unreduced, until then; once cast where it is made, the lowering can reduce-scatter it there
    (``backends/_early.py``). Values and bits are unchanged: the same ops read the same
    inputs, only earlier."""
    from ._types import Phase

    readers: dict[Ref, int] = {}
    for n in graph.nodes:
        for r in n.refs():
            readers[r] = readers.get(r, 0) + 1
    for o in graph.outputs:
        readers[o.ref] = readers.get(o.ref, 0) + 1
    phase = {n.name: n.phase for n in graph.nodes}
    after: dict[str, list[Node]] = {}
    moved: set[str] = set()
    for n in graph.nodes:
        refs = list(n.refs())
        if (n.kind is NodeKind.OP and n.target == "aten._to_copy.default"
                and n.phase is Phase.BACKWARD and len(refs) == 1 and readers[refs[0]] == 1
                and phase[refs[0].node] is Phase.BACKWARD):    # stays inside the backward
            after.setdefault(refs[0].node, []).append(n)
            moved.add(n.name)
    if not moved:
        return graph
    out: list[Node] = []

    def emit(n: Node) -> None:
        out.append(n)
        for m in after.get(n.name, ()):     # a cast of a moved cast follows it
            emit(m)

    for n in graph.nodes:
        if n.name not in moved:
            emit(n)
    return Graph(tuple(out), graph.outputs, graph.info)


def eliminate_dead_code(graph: Graph) -> Graph:
    """Drop op, host and constant nodes whose values never reach an output. Inputs stay: they
    are the calling convention."""
    live = {o.ref.node for o in graph.outputs}
    keep: list[Node] = []
    for n in reversed(graph.nodes):
        if n.kind is NodeKind.INPUT or n.name in live:
            keep.append(n)
            live.update(r.node for r in n.refs())
    return Graph(tuple(reversed(keep)), graph.outputs, graph.info)


def run_passes(graph: Graph, passes: tuple[Pass, ...], *, check: bool = False) -> Graph:
    """Apply ``passes`` in order; with ``check`` verify the graph after each one."""
    from ._verify import verify

    for p in passes:
        graph = p(graph)
        if check:
            verify(graph)
    return graph
