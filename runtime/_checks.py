"""Checks of a call's arguments on the controller, before any rank runs: index values a rank
would fail on, and which would stop every rank with the state in their memory.

A token id past an embedding's rows, or a class id past a loss's classes, fails inside aten on
the rank that holds it; the other ranks then wait for it in a collective and the mesh is torn
down. The plan knows both bounds (the embedding's weight shape, the loss input's class
dimension), so where such an index is one of the step's tensor arguments, as such or through
ops that only reshape it, the controller checks its values (a min and a max over the batch)
and raises one ``RuntimeFailure`` naming the argument, the value, the bound and the line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._errors import RuntimeFailure
from ..ir import Graph, Node, NodeKind, Ref, Role

# ops that only reshape their first argument: its values are the input's
_SAME_VALUES = frozenset({
    "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
    "aten.clone.default", "aten.alias.default", "aten.contiguous.default",
    "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.default",
    "aten.squeeze.dims", "aten.permute.default", "aten.t.default", "aten.flatten.using_ints",
    "aten.expand.default", "aten.transpose.int",
})
_LOSSES = ("aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default")


@dataclass(frozen=True)
class IndexCheck:
    """Values of data input ``name`` must lie in ``[0, bound)`` (or equal ``ignore``)."""

    name: str
    bound: int
    what: str                          # "token ids of an embedding with 50 rows"
    where: str                         # the op's line and module, or ""
    ignore: int | None = None


def index_checks(graph: Graph) -> tuple[IndexCheck, ...]:
    """The index checks ``graph``'s embeddings and classification losses allow."""
    nodes = {n.name: n for n in graph.nodes}
    data = {n.name: n.target for n in graph.inputs_with_role(Role.DATA)}
    out: list[IndexCheck] = []
    for n in graph.nodes:
        if n.kind is not NodeKind.OP:
            continue
        if n.target == "aten.embedding.default" and len(n.args) >= 2:
            name = _data_source(n.args[1], nodes, data)
            rows = _shape(n.args[0], nodes)
            if name is not None and rows:
                out.append(IndexCheck(name, rows[0], f"token ids of an embedding with {rows[0]} "
                                      "rows", _where(n)))
        elif n.target in _LOSSES and len(n.args) >= 2:
            name = _data_source(n.args[1], nodes, data)
            scores = _shape(n.args[0], nodes)
            ignore = n.args[4] if len(n.args) > 4 and isinstance(n.args[4], int) else -100
            if name is not None and scores:
                classes = scores[1] if len(scores) > 1 else scores[0]
                out.append(IndexCheck(name, classes, f"class ids of a loss over {classes} "
                                      "classes", _where(n), ignore))
    return tuple(dict.fromkeys(out))


def check_indices(checks: tuple[IndexCheck, ...], batch: dict[str, torch.Tensor],
                  step_name: str) -> None:
    """Raise before dispatch when a call's argument breaks one of ``checks``."""
    for c in checks:
        t = batch.get(c.name)
        if t is None or t.numel() == 0 or t.dtype.is_floating_point or t.dtype.is_complex:
            continue
        bad = (t < 0) | (t >= c.bound)
        if c.ignore is not None:
            bad &= t != c.ignore
        if bool(bad.any()):
            first = t[bad].reshape(-1)[0].item()
            at = tuple(int(i) for i in (bad.nonzero()[0]))
            allowed = f"0..{c.bound - 1}" + (f" or {c.ignore}" if c.ignore is not None else "")
            raise RuntimeFailure(
                f"{step_name}: argument {c.name!r} holds {first} at {list(at)}, out of range "
                f"for the {c.what} ({allowed}){c.where}; nothing ran and the mesh and its "
                "state are as before the call: fix the batch (or the model's size) and call "
                "again")


def _data_source(arg: object, nodes: dict[str, Node], data: dict[str, str]) -> str | None:
    """The data input whose values ``arg`` is, through reshaping ops only; None otherwise."""
    while isinstance(arg, Ref):
        if arg.node in data:
            return data[arg.node]
        n = nodes.get(arg.node)
        if n is None or n.kind is not NodeKind.OP or n.target not in _SAME_VALUES or not n.args:
            return None
        arg = n.args[0]
    return None


def _shape(arg: object, nodes: dict[str, Node]) -> tuple[int, ...] | None:
    if not isinstance(arg, Ref) or arg.node not in nodes:
        return None
    meta = nodes[arg.node].outputs[arg.index]
    return tuple(getattr(meta, "shape", ())) or None


def _where(n: Node) -> str:
    at = f" at {n.source}" if n.source is not None else ""
    module = f" in {n.module_path}" if n.module_path else ""
    return f"{module}{at}"


__all__ = ["IndexCheck", "check_indices", "index_checks"]
