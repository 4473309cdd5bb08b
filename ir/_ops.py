"""Resolving node targets to callables, and per-node FLOP and byte counts."""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, Callable

import torch

from .._errors import IRError
from ._graph import Graph, Node
from ._types import NodeKind, Ref, TensorMeta

# Host functions: Python scalar arithmetic that make_fx records when optimizer code computes
# with a step counter read by ``.item()``. Closed set; anything else is rejected at trace time.
HOST_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "operator.add": operator.add,
    "operator.sub": operator.sub,
    "operator.mul": operator.mul,
    "operator.truediv": operator.truediv,
    "operator.floordiv": operator.floordiv,
    "operator.mod": operator.mod,
    "operator.pow": operator.pow,
    "operator.neg": operator.neg,
    "math.sqrt": math.sqrt,
    "math.exp": math.exp,
    "math.log": math.log,
    "torch.sym_float": torch.sym_float,
    "torch.sym_int": torch.sym_int,
    "torch.sym_sqrt": getattr(torch, "_sym_sqrt", math.sqrt),
}
_HOST_NAMES = {id(fn): name for name, fn in HOST_FUNCTIONS.items()}


def host_function_name(fn: Callable[..., Any]) -> str | None:
    """The IR name of a host function, or None if it is not in the closed set."""
    return _HOST_NAMES.get(id(fn))


def op_name(op: torch._ops.OpOverload) -> str:
    """``torch.ops.aten.addmm.default`` -> ``"aten.addmm.default"``."""
    ns = op.namespace
    return f"{ns}.{op._schema.name.split('::', 1)[1]}.{op._overloadname}"


@functools.lru_cache(maxsize=None)
def resolve_op(target: str) -> torch._ops.OpOverload:
    """``"aten.addmm.default"`` -> the torch op overload; IRError if it does not exist."""
    parts = target.split(".")
    if len(parts) != 3:
        raise IRError(f"op target {target!r} is not of the form namespace.op.overload")
    ns, name, overload = parts
    try:
        return getattr(getattr(getattr(torch.ops, ns), name), overload)
    except (AttributeError, RuntimeError):
        raise IRError(
            f"op {target!r} does not exist in torch {torch.__version__}; "
            "the graph was made by another torch version or is corrupt"
        ) from None


def resolve(node: Node) -> Callable[..., Any]:
    if node.kind is NodeKind.OP:
        return resolve_op(node.target)
    if node.kind is NodeKind.HOST:
        try:
            return HOST_FUNCTIONS[node.target]
        except KeyError:
            raise IRError(f"node {node.name}: unknown host function {node.target!r}") from None
    raise IRError(f"node {node.name} of kind {node.kind.value} is not callable")


@functools.lru_cache(maxsize=None)
def is_view_op(target: str) -> bool:
    """True if the op returns an alias of an input (a view); views move no bytes."""
    schema = resolve_op(target)._schema
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


@functools.lru_cache(maxsize=None)
def is_mutating_op(target: str) -> bool:
    """True if the op writes into one of its arguments (``add_``, ``copy_``, ``out=`` forms)."""
    schema = resolve_op(target)._schema
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


# ---- FLOPs and bytes ---------------------------------------------------------------------

def _meta_tensor(m: TensorMeta) -> torch.Tensor:
    return torch.empty(m.shape, dtype=getattr(torch, m.dtype), device="meta")


def _materialize(graph: Graph, a: Any) -> Any:
    if isinstance(a, Ref):
        m = graph.meta(a)
        return _meta_tensor(m) if isinstance(m, TensorMeta) else 1.0
    if isinstance(a, tuple):
        return [_materialize(graph, x) for x in a]
    return a


def _input_metas(graph: Graph, node: Node) -> list[TensorMeta]:
    seen: dict[Ref, TensorMeta] = {}
    for r in node.refs():
        m = graph.meta(r)
        if isinstance(m, TensorMeta):
            seen.setdefault(r, m)
    return list(seen.values())


def node_flops(graph: Graph, node: Node) -> int:
    """Floating-point operations of one node.

    Matmuls, convolutions and attention use torch's own FLOP formulas
    (``torch.utils.flop_counter``); other compute ops count one operation per element of their
    largest operand; views, creation ops, inputs and host scalars count zero.
    """
    if node.kind is not NodeKind.OP or is_view_op(node.target):
        return 0
    from torch.utils.flop_counter import flop_registry

    op = resolve_op(node.target)
    formula = flop_registry.get(op._overloadpacket)
    outs = [m for m in node.outputs if isinstance(m, TensorMeta)]
    if formula is not None:
        args = [_materialize(graph, a) for a in node.args]
        kwargs = {k: _materialize(graph, v) for k, v in node.kwargs}
        # keep absent outputs (None) in place: formulas index outputs by position
        out = [_meta_tensor(m) if isinstance(m, TensorMeta) else None for m in node.outputs]
        out_val = out[0] if len(out) == 1 else tuple(out)
        return int(formula(*args, out_val=out_val, **kwargs))
    ins = _input_metas(graph, node)
    if not ins:
        return 0
    return max(m.numel for m in ins + outs)


def node_bytes(graph: Graph, node: Node) -> int:
    """Bytes read plus bytes written by one node (zero for views, inputs and host scalars)."""
    if node.kind is not NodeKind.OP or is_view_op(node.target):
        return 0
    read = sum(m.nbytes for m in _input_metas(graph, node))
    written = sum(m.nbytes for m in node.outputs if isinstance(m, TensorMeta))
    return read + written
