"""Helpers shared by the rule families: reading a node's arguments by schema name, laying out
placements in ``node.refs()`` order, dim arithmetic, and localize functions for shape literals.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from ...ir import Node, Ref, TensorMeta, resolve_op
from .._placement import P_AVG, P_SUM, Partial, Placement, R, Shard
from ._registry import OpInfo, OpStrategy, RuleFn, Shape, sharding_rule

PARTIALS: tuple[Partial, ...] = (P_SUM, P_AVG)
Spec = Mapping[str, Placement | Sequence[Placement]]


@functools.lru_cache(maxsize=None)
def arg_names(target: str) -> tuple[str, ...]:
    return tuple(a.name for a in resolve_op(target)._schema.arguments)


@functools.lru_cache(maxsize=None)
def _defaults(target: str) -> dict[str, Any]:
    return {a.name: a.default_value for a in resolve_op(target)._schema.arguments
            if a.has_default_value()}


def arg(node: Node, name: str, default: Any = None) -> Any:
    """The value of schema argument ``name`` (positional or keyword), else its schema default."""
    names = arg_names(node.target)
    i = names.index(name)
    if i < len(node.args):
        return node.args[i]
    kw = dict(node.kwargs)
    if name in kw:
        return kw[name]
    return _defaults(node.target).get(name, default)


def ref_slots(node: Node) -> list[tuple[str, int]]:
    """For each Ref in ``node.refs()`` order: (schema argument name, index inside a list arg)."""
    names = arg_names(node.target)
    slots: list[tuple[str, int]] = []

    def walk(name: str, a: Any) -> None:
        if isinstance(a, Ref):
            slots.append((name, 0))
        elif isinstance(a, tuple):
            for j, x in enumerate(a):
                if isinstance(x, Ref):
                    slots.append((name, j))

    for i, a in enumerate(node.args):
        walk(names[i], a)
    for k, v in node.kwargs:
        walk(k, v)
    return slots


def place(info: OpInfo, spec: Spec, default: Placement = R) -> tuple[Placement | None, ...]:
    """Input placements in refs order from ``{argument name: placement}`` (a list argument may
    map to one placement for all elements or a sequence, one per element). Host scalars get
    None; arguments not in ``spec`` get ``default``."""
    out: list[Placement | None] = []
    for (name, j), m in zip(ref_slots(info.node), info.inputs):
        if m is None:
            out.append(None)
            continue
        p = spec.get(name, default)
        out.append(p[j] if isinstance(p, (tuple, list)) else p)
    return tuple(out)


def outs(info: OpInfo, *ps: Placement) -> tuple[Placement | None, ...]:
    """Output placements aligned with ``info.outputs`` (None for absent outputs); a single
    placement is used for every tensor output."""
    if len(ps) == 1:
        ps = ps * len(info.outputs)
    return tuple(None if m is None else p for m, p in zip(info.outputs, ps))


def strategy(info: OpInfo, spec: Spec, *out: Placement, default: Placement = R) -> OpStrategy:
    return OpStrategy(place(info, spec, default), outs(info, *out))


def tensor_in(info: OpInfo, name: str, j: int = 0) -> TensorMeta | None:
    """Metadata of the tensor passed as argument ``name`` (element ``j`` of a list)."""
    for (n, k), m in zip(ref_slots(info.node), info.inputs):
        if n == name and k == j:
            return m
    return None


def out0(info: OpInfo) -> TensorMeta:
    m = info.outputs[0]
    assert isinstance(m, TensorMeta)
    return m


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def norm_dims(dims: Any, ndim: int) -> list[int]:
    """Reduction dims as a sorted list of non-negative dims; None or () means every dim."""
    if dims is None or (isinstance(dims, tuple) and len(dims) == 0):
        return list(range(ndim))
    if isinstance(dims, int):
        dims = (dims,)
    return sorted({norm_dim(d, max(ndim, 1)) for d in dims})


def is_float(m: TensorMeta | None) -> bool:
    return m is not None and m.dtype.startswith(("float", "bfloat", "complex"))


def shardable(m: TensorMeta) -> Iterable[int]:
    """Dims worth sharding: every dim of size > 1."""
    return (d for d, s in enumerate(m.shape) if s > 1)


# ---- localize ----------------------------------------------------------------------------

def keep_literals(node: Node, ins: Sequence[Shape | None],
                  outs_: Sequence[Shape | None]) -> tuple[tuple, tuple]:
    """Run the local op with the node's own arguments. For ops whose int tuples are dims, split
    sizes, kernel sizes or normalized shapes, never shapes: ``default_localize`` would rewrite
    such a tuple when it happens to equal an output's global shape (``sum(x, [2, 3])`` of an
    ``x`` of shape ``[2, 3, 2, 3]``)."""
    return node.args, node.kwargs


def localize_arg(*names: str, output: int = 0):
    """A localize function that sets the shape argument (the first of ``names`` the op has) to
    the local shape of output ``output`` (``view``'s size may hold -1, ``expand``'s -1)."""

    def localize(node: Node, ins: Sequence[Shape | None],
                 outs_: Sequence[Shape | None]) -> tuple[tuple, tuple]:
        shape = outs_[output]
        schema = arg_names(node.target)
        name = next(n for n in names if n in schema)
        i = schema.index(name)
        args = list(node.args)
        kwargs = dict(node.kwargs)
        if shape is not None and i < len(args):
            args[i] = tuple(shape)
        elif shape is not None and name in kwargs:
            kwargs[name] = tuple(shape)
        return tuple(args), tuple(kwargs.items())

    localize.__qualname__ = f"localize_arg{names!r}"
    return localize


def literal_rule(*targets: str) -> Callable[[RuleFn], RuleFn]:
    """``sharding_rule`` with ``keep_literals``, for ops whose int tuples are not shapes."""
    return sharding_rule(*targets, localize=keep_literals)


def like_input(info: OpInfo) -> Iterator[OpStrategy]:
    """An op whose output takes its first input's shape and none of its values (``ones_like``,
    ``rand_like``): split the input along any dim and the output splits alike; a partial input
    (a sum still to be made) gives a whole output on every rank."""
    x = info.inputs[0]
    assert x is not None
    for d in shardable(x):
        yield OpStrategy(place(info, {"self": Shard(d)}), outs(info, Shard(d)))
    for p in PARTIALS:
        yield OpStrategy(place(info, {"self": p}), outs(info, R))
