"""Facts about a graph for people: counts by kind and op, parameters, FLOPs, big activations."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ._graph import Graph
from ._ops import is_view_op, node_bytes, node_flops
from ._types import NodeKind, Phase, Role, TensorMeta


@dataclass(frozen=True, slots=True)
class ValueFact:
    node: str
    target: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    where: str


@dataclass(frozen=True, slots=True)
class GraphSummary:
    name: str
    nodes_by_kind: tuple[tuple[str, int], ...]
    nodes_by_phase: tuple[tuple[str, int], ...]
    ops: tuple[tuple[str, int], ...]            # op target -> count, most frequent first
    inputs_by_role: tuple[tuple[str, int, int], ...]  # role, count, bytes
    num_params: int
    flops: int
    flops_by_phase: tuple[tuple[str, int], ...]
    bytes_moved: int
    largest_activations: tuple[ValueFact, ...]


def summarize(graph: Graph, *, top: int = 8) -> GraphSummary:
    kinds = Counter(n.kind.value for n in graph.nodes)
    phases = Counter(n.phase.value for n in graph.nodes if n.kind is NodeKind.OP)
    ops = Counter(n.target for n in graph.nodes if n.kind is NodeKind.OP)
    roles: dict[str, list[int]] = {}
    for n in graph.inputs:
        acc = roles.setdefault(n.meta.role.value, [0, 0])
        acc[0] += 1
        acc[1] += n.meta.nbytes
    flops_by_phase: Counter[str] = Counter()
    moved = 0
    acts: list[ValueFact] = []
    for n in graph.nodes:
        if n.kind is not NodeKind.OP:
            continue
        flops_by_phase[n.phase.value] += node_flops(graph, n)
        moved += node_bytes(graph, n)
        if is_view_op(n.target):
            continue
        for m in n.outputs:
            if isinstance(m, TensorMeta) and m.role in (Role.ACTIVATION, Role.GRAD) and (
                n.phase is not Phase.UPDATE
            ):
                where = str(n.source) if n.source else ""
                acts.append(ValueFact(n.name, n.target, m.shape, m.dtype, m.nbytes, where))
    acts.sort(key=lambda v: -v.nbytes)
    return GraphSummary(
        name=graph.info.name,
        nodes_by_kind=tuple(sorted(kinds.items())),
        nodes_by_phase=tuple((p.value, phases[p.value]) for p in Phase),
        ops=tuple(ops.most_common()),
        inputs_by_role=tuple((r, c, b) for r, (c, b) in sorted(roles.items())),
        num_params=graph.num_params(),
        flops=sum(flops_by_phase.values()),
        flops_by_phase=tuple((p.value, flops_by_phase[p.value]) for p in Phase),
        bytes_moved=moved,
        largest_activations=tuple(acts[:top]),
    )
