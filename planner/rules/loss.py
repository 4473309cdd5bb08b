"""Losses: negative log-likelihood (``nll_loss_forward/backward``, 2-D variants) and mean squared
error (``mse_loss`` and its backward). ``reduction`` is 0 none, 1 mean, 2 sum.

nll_loss over split samples (dim 0 of the input and of the targets; ``nll_loss2d`` also its
spatial dims): with ``sum`` the loss is ``P(sum)`` and ``total_weight`` (the count or the
weight sum) ``P(sum)`` too (with ``none`` it is always 0, replicated). ``mean`` does not split
the samples: every rank would divide by its own count, and a mean of the pieces' means is the
whole's only where every piece counts the same (DTensor offers it as ``P(avg)``; a batch with
padding targets equal to ``ignore_index`` is not). The trace writes a mean as ``sum`` divided
by ``total_weight`` (``frontend/_decomp.py``), which splits exactly. The backward takes the
GLOBAL ``total_weight`` (replicated), so split samples give a split gradient exactly. Both
directions are linear in the log-probabilities / the incoming gradient: partials pass.

mse_loss over any split dim: ``mean`` gives ``P(avg)`` (equal shards), ``sum`` ``P(sum)``.
Its backward with ``mean`` divides by the element count of the tensor it is given, so on split
inputs ATen's op would give a gradient ``k`` times too large: each rank runs
``mse_loss_backward_local`` instead, ATen's formula with the whole tensor's count (which no
argument of the op carries: ``localize`` adds it), so split inputs give a split gradient
exactly. A partial incoming gradient (replicated inputs) passes too.

The other elementwise losses (``smooth_l1_loss``, ``huber_loss``, ``binary_cross_entropy``,
``soft_margin_loss``) split the same way. Their backward with ``mean`` on a piece runs as the
op with ``sum`` on the incoming gradient times 1 / (the whole count) (``_WholeMean``): the
same value, the count applied first rather than last (within a rounding of ATen's on the
whole tensor). ``binary_cross_entropy``'s ``weight`` splits with its input where it has its
shape, and stays replicated where it broadcasts along a split dim.
"""

from __future__ import annotations

from math import prod
from typing import Iterator, Sequence

import torch
from torch import Tensor

from ...ir import Node
from .._placement import P_AVG, P_SUM, R, Shard
from ._registry import OpInfo, OpStrategy, Shape, sharding_rule
from ._util import (
    PARTIALS,
    arg,
    is_float,
    keep_literals,
    literal_rule,
    outs,
    place,
    shardable,
    strategy,
    tensor_in,
)

NONE, MEAN, SUM = 0, 1, 2


def _sample_dims(info: OpInfo) -> list[int]:
    """Dims of ``target`` (aligned with the input's dims except the class dim 1)."""
    t = tensor_in(info, "target")
    x = tensor_in(info, "self")
    if t is None or x is None or len(x.shape) < 2:
        return []
    return list(shardable(t))


def _input_dim(d: int) -> int:
    """Target dim -> input dim (the input has the class dim inserted at 1)."""
    return 0 if d == 0 else d + 1


def _weighted(info: OpInfo) -> bool:
    return tensor_in(info, "weight") is not None


@literal_rule("aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default")
def nll_loss(info: OpInfo) -> Iterator[OpStrategy]:
    red = arg(info.node, "reduction")
    for d in _sample_dims(info):
        ins = place(info, {"self": Shard(_input_dim(d)), "target": Shard(d)})
        if red == NONE:
            yield OpStrategy(ins, outs(info, Shard(d), R))
        elif red == SUM:
            yield OpStrategy(ins, outs(info, P_SUM, P_SUM))
    if red != NONE and is_float(tensor_in(info, "self")):
        for p in PARTIALS:
            yield OpStrategy(place(info, {"self": p}), outs(info, p, R))


@literal_rule("aten.nll_loss_backward.default", "aten.nll_loss2d_backward.default")
def nll_loss_backward(info: OpInfo) -> Iterator[OpStrategy]:
    red = arg(info.node, "reduction")
    for d in _sample_dims(info):
        spec = {"self": Shard(_input_dim(d)), "target": Shard(d)}
        if red == NONE:
            spec["grad_output"] = Shard(d)
        yield strategy(info, spec, Shard(_input_dim(d)))
    if is_float(tensor_in(info, "grad_output")):
        for p in PARTIALS:
            yield strategy(info, {"grad_output": p}, p)


def _same_shape(info: OpInfo) -> bool:
    x, t = tensor_in(info, "self"), tensor_in(info, "target")
    return x is not None and t is not None and x.shape == t.shape


@literal_rule("aten.mse_loss.default")
def mse_loss(info: OpInfo) -> Iterator[OpStrategy]:
    if not _same_shape(info):
        return
    red = arg(info.node, "reduction")
    x = tensor_in(info, "self")
    assert x is not None
    for d in shardable(x):
        s = Shard(d)
        yield strategy(info, {"self": s, "target": s}, {NONE: s, MEAN: P_AVG, SUM: P_SUM}[red])


def mse_loss_backward_local(grad_output: Tensor, self: Tensor, target: Tensor,
                            reduction: int = MEAN, count: int | None = None) -> Tensor:
    """``mse_loss_backward`` on one rank's piece; ``count``: the whole input's element count
    where the piece is not all of it (``mean`` divides by it). ATen's kernel computes
    ``norm * (self - target) * grad_output`` with ``norm`` = 2 / count (mean) rounded to the
    input's dtype; the same operations in the same order give the same bits."""
    if count is None or reduction != MEAN:
        return torch.ops.aten.mse_loss_backward.default(grad_output, self, target, reduction)
    norm = torch.tensor(2.0 / count, dtype=self.dtype)
    return norm * (self - target) * grad_output


def _whole_count(node: Node, ins: Sequence[Shape | None],
                 outs_: Sequence[Shape | None]) -> tuple[tuple, tuple]:
    """A loss backward's own arguments, and with ``mean`` over a piece of the input the whole
    input's element count (``count=``, read by the rank's stand-in for the op)."""
    whole = node.outputs[0].shape
    piece = outs_[0]
    if arg(node, "reduction") != MEAN or piece is None or prod(piece) == prod(whole):
        return node.args, node.kwargs
    return node.args, (*node.kwargs, ("count", prod(whole)))


@sharding_rule("aten.mse_loss_backward.default", localize=_whole_count,
               local_op=mse_loss_backward_local)
def mse_loss_backward(info: OpInfo) -> Iterator[OpStrategy]:
    red = arg(info.node, "reduction")
    x = tensor_in(info, "self")
    assert x is not None
    if _same_shape(info):
        for d in shardable(x):
            s = Shard(d)
            g = s if red == NONE else R
            yield strategy(info, {"grad_output": g, "self": s, "target": s}, s)
    if is_float(tensor_in(info, "grad_output")):
        for p in PARTIALS:
            yield strategy(info, {"grad_output": p}, p)


# ---- the other elementwise losses -----------------------------------------------------------

# forward op -> its backward op, and the position of ``reduction`` in the backward's arguments
ELEMENTWISE_LOSSES = {
    "aten.smooth_l1_loss.default": ("aten.smooth_l1_loss_backward.default", 3),
    "aten.huber_loss.default": ("aten.huber_loss_backward.default", 3),
    "aten.binary_cross_entropy.default": ("aten.binary_cross_entropy_backward.default", 4),
    "aten.soft_margin_loss.default": ("aten.soft_margin_loss_backward.default", 3),
}


def _split_specs(info: OpInfo, x: Shard) -> dict[str, object] | None:
    """``self`` and ``target`` split on ``x.dim``; an elementwise ``weight`` too where it has
    the input's size there (else it broadcasts along it: replicated). None where the target
    does not have the input's shape."""
    if not _same_shape(info):
        return None
    spec: dict[str, object] = {"self": x, "target": x}
    w, inp = tensor_in(info, "weight"), tensor_in(info, "self")
    if w is not None and inp is not None:
        at = x.dim - (len(inp.shape) - len(w.shape))
        spec["weight"] = Shard(at) if at >= 0 and w.shape[at] == inp.shape[x.dim] else R
    return spec


def _splits(info: OpInfo) -> Iterator[tuple[Shard, dict[str, object], int]]:
    """Each split dim of the input with its ``_split_specs``, and the reduction."""
    red = arg(info.node, "reduction")
    x = tensor_in(info, "self")
    assert x is not None
    for d in shardable(x):
        spec = _split_specs(info, Shard(d))
        if spec is not None:
            yield Shard(d), spec, red


def elementwise_loss(info: OpInfo) -> Iterator[OpStrategy]:
    for s, spec, red in _splits(info):
        yield strategy(info, spec, {NONE: s, MEAN: P_AVG, SUM: P_SUM}[red])


def elementwise_loss_backward(info: OpInfo) -> Iterator[OpStrategy]:
    for s, spec, red in _splits(info):
        spec["grad_output"] = s if red == NONE else R
        yield strategy(info, spec, s)
    if is_float(tensor_in(info, "grad_output")):          # linear in the incoming gradient
        for p in PARTIALS:
            yield strategy(info, {"grad_output": p}, p)


class _WholeMean:
    """A mean loss's backward on one rank's piece (``count=``: the whole input's element
    count): the op with ``sum`` on the incoming gradient times 1 / count."""

    def __init__(self, target: str, at: int) -> None:
        _, name, overload = target.split(".")
        self.op = getattr(getattr(torch.ops.aten, name), overload)
        self.at = at                      # the position of ``reduction``

    def __call__(self, *args: object, count: int | None = None, **kwargs: object) -> Tensor:
        red = args[self.at] if len(args) > self.at else kwargs.get("reduction", MEAN)
        if count is None or red != MEAN:
            return self.op(*args, **kwargs)
        grad = args[0]
        assert isinstance(grad, Tensor)
        args = (grad * torch.tensor(1.0 / count, dtype=grad.dtype), *args[1:])
        if len(args) > self.at:
            args = (*args[:self.at], SUM, *args[self.at + 1:])
        else:
            kwargs = {**kwargs, "reduction": SUM}
        return self.op(*args, **kwargs)


for _fwd, (_bwd, _at) in ELEMENTWISE_LOSSES.items():
    sharding_rule(_fwd, localize=keep_literals)(elementwise_loss)
    sharding_rule(_bwd, localize=_whole_count, local_op=_WholeMean(_bwd, _at))(
        elementwise_loss_backward)
