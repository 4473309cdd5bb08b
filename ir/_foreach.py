"""``split_foreach``: replace every ``aten._foreach_*`` node by one per-tensor node per element.

Optimizers and ``clip_grad_norm_`` with ``foreach=True`` trace to ops that take lists of tensors
and return lists. Sharding rules are written for single tensors, so this pass rewrites each
foreach node into the single-tensor ops that ATen's own CPU implementation (the "slow path",
``ForeachOpsKernels.cpp``) calls element by element, e.g. ``_foreach_add.Scalar`` ->
``add.Scalar``, ``_foreach_maximum.Scalar`` -> ``clamp_min``, ``_foreach_norm.Scalar`` ->
``linalg_vector_norm``. On CPU the result is therefore bit-identical; on CUDA, where foreach ops
run fused kernels, the per-tensor ops are the reference semantics.

Readers of output ``k`` of a foreach node are rewired to the ``k``-th new node; the new nodes keep
the original node's phase, source location and module path. A foreach op without a mapping
raises :class:`IRError` naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from .._errors import IRError
from ._graph import Graph, Node
from ._ops import resolve_op
from ._passes import _rewrite
from ._types import NodeKind, Ref, Role, ScalarMeta, TensorMeta

__all__ = ["split_foreach"]

_PREFIX = "aten._foreach_"

# Unary list ops: _foreach_<op>.default -> <op>.default (``t.<op>()`` in ATen).
_UNARY = frozenset({
    "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "expm1",
    "floor", "frac", "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round",
    "rsqrt", "sigmoid", "sign", "sin", "sinh", "sqrt", "tan", "tanh", "trunc", "max", "clone",
})
_ARITH = ("add", "sub", "mul", "div")
_SCALARISH = ("Scalar", "ScalarList")


def _table() -> dict[str, str]:
    """foreach overload (without the ``aten._foreach_`` prefix) -> per-tensor op target."""
    t: dict[str, str] = {f"{u}.default": f"aten.{u}.default" for u in _UNARY}
    for op in _ARITH:
        t[f"{op}.List"] = f"aten.{op}.Tensor"
        if op != "sub":  # there is no _foreach_sub.Tensor
            t[f"{op}.Tensor"] = f"aten.{op}.Tensor"
        t.update({f"{op}.{o}": f"aten.{op}.Scalar" for o in _SCALARISH})
    for op, scalar_op in (("maximum", "clamp_min"), ("minimum", "clamp_max"),
                          ("clamp_min", "clamp_min"), ("clamp_max", "clamp_max")):
        list_op = f"aten.{op}.default" if op in ("maximum", "minimum") else f"aten.{op}.Tensor"
        t[f"{op}.List"] = list_op
        t.update({f"{op}.{o}": f"aten.{scalar_op}.default" for o in _SCALARISH})
    for op in ("addcmul", "addcdiv"):
        t.update({f"{op}.{o}": f"aten.{op}.default" for o in (*_SCALARISH, "Tensor")})
    t.update({
        "pow.List": "aten.pow.Tensor_Tensor", "pow.Scalar": "aten.pow.Tensor_Scalar",
        "pow.ScalarList": "aten.pow.Tensor_Scalar", "pow.ScalarAndTensor": "aten.pow.Scalar",
        "lerp.List": "aten.lerp.Tensor", "lerp.Scalar": "aten.lerp.Scalar",
        "lerp.ScalarList": "aten.lerp.Scalar",
        "norm.Scalar": "aten.linalg_vector_norm.default",
        "copy.default": "aten.copy.default", "zero.default": "aten.zeros_like.default",
        "mm.default": "aten.mm.default",
    })
    return t


FOREACH_TARGETS: dict[str, str] = {_PREFIX + k: v for k, v in _table().items()}

# Per-tensor argument names where they do not follow the foreach schema's positions.
_RENAMES: dict[str, tuple[str, ...]] = {
    "aten.linalg_vector_norm.default": ("self", "ord", "dtype"),
    "aten.addcmul.default": ("self", "tensor1", "tensor2", "value"),
    "aten.addcdiv.default": ("self", "tensor1", "tensor2", "value"),
}


def split_foreach(graph: Graph) -> Graph:
    """Replace each ``aten._foreach_*`` node by per-tensor nodes; bit-identical on CPU."""
    names = {n.name for n in graph.nodes}
    subst: dict[Ref, Ref] = {}
    nodes: list[Node] = []
    made: dict[str, Node] = {}

    def meta_of(r: Ref) -> Any:
        src = made.get(r.node)
        return src.outputs[r.index] if src is not None else graph.meta(r)

    for n in graph.nodes:
        if subst:
            n = dataclasses.replace(n, args=_rewrite(n.args, subst),
                                    kwargs=tuple((k, _rewrite(v, subst)) for k, v in n.kwargs))
        if n.kind is NodeKind.OP and n.target.startswith(_PREFIX):
            for k, new in enumerate(_split(n, meta_of, names)):
                nodes.extend(new)
                made.update((m.name, m) for m in new)
                subst[Ref(n.name, k)] = Ref(new[-1].name, 0)
        else:
            nodes.append(n)
    outputs = tuple(dataclasses.replace(o, ref=subst.get(o.ref, o.ref)) for o in graph.outputs)
    return Graph(tuple(nodes), outputs, graph.info)


def _split(node: Node, meta_of: Callable[[Ref], Any], names: set[str]) -> list[list[Node]]:
    """One list of new nodes per element (the element's value is the last node's output 0)."""
    target = FOREACH_TARGETS.get(node.target)
    if target is None:
        raise IRError(
            f"node {node.name}: no per-tensor mapping for {node.target}"
            f"{_where(node)}; split_foreach knows {len(FOREACH_TARGETS)} foreach overloads; "
            "add this one to ir/_foreach.py or trace with foreach=False"
        )
    schema = resolve_op(node.target)._schema
    named = _bind(node, schema)
    lists = [a.name for a in schema.arguments if isinstance(a.type, torch._C.ListType)]
    n_el = len(node.outputs)
    for a in lists:
        if a in named and len(named[a]) != n_el:
            raise IRError(f"node {node.name}: {node.target} has {n_el} outputs but argument "
                          f"{a!r} holds {len(named[a])} elements")
    tensor_scalars = ("addcmul" in target or "addcdiv" in target) and node.target.endswith(
        ".Tensor")
    out = []
    for k in range(n_el):
        el = {a: (v[k] if a in lists else v) for a, v in named.items()}
        pre: list[Node] = []
        if tensor_scalars:  # a 1-D tensor of per-element scalars: read element k on the host
            el["scalars"], pre = _scalar_from_tensor(node, meta_of, el["scalars"], k, names)
        args, kwargs = _call_args(target, schema, el)
        meta = node.outputs[k]
        new = dataclasses.replace(node, name=_fresh(f"{node.name}_{k}", names), target=target,
                                  args=args, kwargs=kwargs, outputs=(meta,))
        out.append([*pre, new])
    return out


def _bind(node: Node, schema: Any) -> dict[str, Any]:
    """Schema argument name -> the node's value (positional args, then keyword args)."""
    named = {schema.arguments[i].name: a for i, a in enumerate(node.args)}
    named.update(dict(node.kwargs))
    return named


def _call_args(target: str, fschema: Any, el: dict[str, Any]) -> tuple[tuple, tuple]:
    """Arguments of the per-tensor op: foreach arguments matched by position (or ``_RENAMES``);
    leading positional arguments stay positional, the rest become keywords."""
    tschema = resolve_op(target)._schema
    fnames = [a.name for a in fschema.arguments]
    tnames = _RENAMES.get(target) or tuple(a.name for a in tschema.arguments[:len(fnames)])
    by_name = {tn: el[fn] for fn, tn in zip(fnames, tnames) if fn in el}
    args: list[Any] = []
    kwargs: list[tuple[str, Any]] = []
    positional = True
    for a in tschema.arguments:
        if a.name not in by_name:
            positional = False
            continue
        if positional and not a.kwarg_only:
            args.append(by_name[a.name])
        else:
            positional = False
            kwargs.append((a.name, by_name[a.name]))
    return tuple(args), tuple(kwargs)


def _scalar_from_tensor(node: Node, meta_of: Callable[[Ref], Any], scalars: Any, k: int,
                        names: set[str]) -> tuple[Ref, list[Node]]:
    """``scalars[k].item()`` as IR nodes (what ATen's ``convert_tensor_to_scalar_list`` does)."""
    if not isinstance(scalars, Ref):
        raise IRError(f"node {node.name}: {node.target} expects a tensor of scalars")
    m = meta_of(scalars)
    if not isinstance(m, TensorMeta):
        raise IRError(f"node {node.name}: the scalars of {node.target} are not a tensor")
    kind = "float" if m.dtype.startswith(("float", "bfloat")) else (
        "bool" if m.dtype == "bool" else "int")
    sel = dataclasses.replace(
        node, name=_fresh(f"{node.name}_scalar_{k}", names), target="aten.select.int",
        args=(scalars, 0, k), kwargs=(), outputs=(TensorMeta((), m.dtype, Role.ACTIVATION),))
    item = dataclasses.replace(
        node, name=_fresh(f"{node.name}_item_{k}", names),
        target="aten._local_scalar_dense.default", args=(Ref(sel.name, 0),), kwargs=(),
        outputs=(ScalarMeta(kind),))
    return Ref(item.name, 0), [sel, item]


def _fresh(base: str, names: set[str]) -> str:
    name, i = base, 0
    while name in names:
        i += 1
        name = f"{base}_{i}"
    names.add(name)
    return name


def _where(node: Node) -> str:
    return f" at {node.source}" if node.source is not None else ""
