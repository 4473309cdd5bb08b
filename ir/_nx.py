"""A networkx view of a graph, for analyses that networkx already does well."""

from __future__ import annotations

from typing import Any

from ._graph import Graph


def to_networkx(graph: Graph) -> Any:
    """A ``networkx.MultiDiGraph``: one vertex per node (attribute ``node``: the IR node), one
    edge per read, keyed by the output index read (attribute ``index``)."""
    import networkx as nx

    g = nx.MultiDiGraph(name=graph.info.name)
    for n in graph.nodes:
        g.add_node(n.name, node=n, kind=n.kind.value, target=n.target)
    for n in graph.nodes:
        for r in dict.fromkeys(n.refs()):
            g.add_edge(r.node, n.name, index=r.index)
    for i, o in enumerate(graph.outputs):
        g.nodes[o.ref.node].setdefault("outputs", []).append(i)
    return g
