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
def view_source(target: str) -> int | None:
    """The position of the argument a view op's result aliases (its schema's alias set), None
    for an op that is not a view."""
    schema = resolve_op(target)._schema
    sets = [r.alias_info.before_set for r in schema.returns
            if r.alias_info is not None and not r.alias_info.is_write]
    if not sets:
        return None
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.before_set & sets[0]:
            return i
    return None


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
    (``torch.utils.flop_counter``; for attention see ``_CPU_ATTENTION``); other compute ops
    count one operation per element of their largest operand; views, creation ops, inputs and
    host scalars count zero.
    """
    if node.kind is not NodeKind.OP or is_view_op(node.target):
        return 0
    from torch.utils.flop_counter import flop_registry

    op = resolve_op(node.target)
    if node.target in _CPU_ATTENTION:
        return _cpu_attention_flops(graph, node, op)
    formula = flop_registry.get(op._overloadpacket)
    outs = [m for m in node.outputs if isinstance(m, TensorMeta)]
    if formula is not None:
        args = [_materialize(graph, a) for a in node.args]
        kwargs = {k: _materialize(graph, v) for k, v in node.kwargs}
        # keep absent outputs (None) in place: formulas index outputs by position
        out = [_meta_tensor(m) if isinstance(m, TensorMeta) else None for m in node.outputs]
        out_val = out[0] if len(out) == 1 else tuple(out)
        flops = int(formula(*args, out_val=out_val, **kwargs))
        causal = "attention" in node.target and _causal(_named_args(node, op))
        return flops // 2 if causal else flops
    ins = _input_metas(graph, node)
    if not ins:
        return 0
    return max(m.numel for m in ins + outs)


# CPU's fused attention (what ``F.scaled_dot_product_attention`` traces to on CPU and meta
# tensors), which torch's FLOP counter does not know: priced as its counter prices the GPU
# kernels (the forward's two matmuls; 2.5 times that for the backward, which recomputes the
# scores). Every attention kernel with a causal mask counts half: a flash kernel skips the
# blocks above the diagonal (torch's counter counts them).
_CPU_ATTENTION = frozenset({"aten._scaled_dot_product_flash_attention_for_cpu.default",
                            "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"})


def _cpu_attention_flops(graph: Graph, node: Node, op: Any) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    given = _named_args(node, op)

    def shape(name: str) -> tuple[int, ...]:
        m = graph.meta(given[name])
        assert isinstance(m, TensorMeta), (node.name, name)
        return tuple(m.shape)

    q, k, v = shape("query"), shape("key"), shape("value")
    if "grad_out" in given:
        flops = sdpa_backward_flop_count(shape("grad_out"), q, k, v)
    else:
        flops = sdpa_flop_count(q, k, v)
    return int(flops // 2 if _causal(given) else flops)


def _named_args(node: Node, op: Any) -> dict[str, Any]:
    names = [a.name for a in op._schema.arguments]
    return dict(zip(names, node.args)) | dict(node.kwargs)


def _causal(args: dict[str, Any]) -> bool:
    return args.get("is_causal") is True


def node_bytes(graph: Graph, node: Node) -> int:
    """Bytes read plus bytes written by one node (zero for views, inputs and host scalars)."""
    if node.kind is not NodeKind.OP or is_view_op(node.target):
        return 0
    read = sum(m.nbytes for m in _input_metas(graph, node))
    written = sum(m.nbytes for m in node.outputs if isinstance(m, TensorMeta))
    return read + written
