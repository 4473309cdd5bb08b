"""Losses: negative log-likelihood (``nll_loss_forward/backward``, 2-D variants) and mean squared
error (``mse_loss`` and its backward). ``reduction`` is 0 none, 1 mean, 2 sum.

nll_loss over split samples (dim 0 of the input and of the targets; ``nll_loss2d`` also its
spatial dims): with ``sum`` the loss is ``P(sum)``; with ``mean`` every rank divides by its own
count, so the loss is ``P(avg)`` -- exact when every shard counts the same number of targets,
i.e. without class weights and without targets equal to ``ignore_index`` (the caveat DTensor
makes too); with class weights only ``sum`` splits. ``total_weight`` (the count or the weight
sum) is then ``P(sum)`` (with ``none`` it is always 0, replicated). The backward takes the
GLOBAL ``total_weight`` (replicated), so split samples give a split gradient exactly. Both
directions are linear in the log-probabilities / the incoming gradient: partials pass.

mse_loss over any split dim: ``mean`` gives ``P(avg)`` (equal shards), ``sum`` ``P(sum)``.
Its backward with ``mean`` divides by the LOCAL element count, so split inputs would give a
gradient ``k`` times too large: only ``none``/``sum`` split; with ``mean`` only a partial
incoming gradient (replicated inputs) passes.
"""

from __future__ import annotations

from typing import Iterator

from .._placement import P_AVG, P_SUM, R, Shard
from ._registry import OpInfo, OpStrategy
from ._util import (
    PARTIALS,
    arg,
    is_float,
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
        elif red == SUM or (red == MEAN and not _weighted(info)):
            yield OpStrategy(ins, outs(info, P_SUM if red == SUM else P_AVG, P_SUM))
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


@literal_rule("aten.mse_loss_backward.default")
def mse_loss_backward(info: OpInfo) -> Iterator[OpStrategy]:
    red = arg(info.node, "reduction")
    x = tensor_in(info, "self")
    assert x is not None
    if _same_shape(info) and red != MEAN:
        for d in shardable(x):
            s = Shard(d)
            g = s if red == NONE else R
            yield strategy(info, {"grad_output": g, "self": s, "target": s}, s)
    if is_float(tensor_in(info, "grad_output")):
        for p in PARTIALS:
            yield strategy(info, {"grad_output": p}, p)
