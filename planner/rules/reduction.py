"""Reductions: sum, mean, amax/amin, max/min along dims, arg-max/min, norms, variance,
logsumexp, cumulative sums, and ``_local_scalar_dense`` (``.item()``).

A dim that is not reduced keeps its shard (renumbered when ``keepdim`` is false). Reducing over
a sharded dim is exact only for linear reductions with equal shards: ``sum`` gives ``P(sum)``
and ``mean`` gives ``P(avg)`` (each rank's mean is over the same number of elements). ``amax``,
norms and variances over a sharded dim have no placement in our vocabulary, so they require that dim
replicated, except the 2-norm, which gives ``P(norm2)``. Linear reductions pass partial inputs
through; nonlinear ones do not.
"""

from __future__ import annotations

from typing import Iterator

from .._placement import P_AVG, P_NORM2, P_SUM, Partial, Placement, Shard
from ._registry import OpInfo, OpStrategy
from ._util import PARTIALS, arg, is_float, literal_rule, norm_dims, outs, place, shardable


def reduce_strategies(info: OpInfo, dims: list[int], keepdim: bool,
                      over_shard: Partial | None, linear: bool) -> Iterator[OpStrategy]:
    """``self`` reduced over ``dims``; ``over_shard`` is the output partial when a reduced dim
    is sharded (None: not allowed); ``linear``: partial inputs pass through."""
    x = info.inputs[0]
    assert x is not None
    for d in shardable(x):
        if d in dims:
            if over_shard is not None and all(is_float(m) for m in info.outputs if m):
                yield _one(info, Shard(d), over_shard)
        else:
            yield _one(info, Shard(d), Shard(d if keepdim else d - sum(r < d for r in dims)))
    if linear and is_float(x) and all(is_float(m) for m in info.outputs if m):
        for p in PARTIALS:
            yield _one(info, p, p)


def _one(info: OpInfo, p_in: Placement, p_out: Placement) -> OpStrategy:
    return OpStrategy(place(info, {"self": p_in}), outs(info, p_out))


def _ndim(info: OpInfo) -> int:
    x = info.inputs[0]
    assert x is not None
    return len(x.shape)


@literal_rule("aten.sum.dim_IntList", "aten.mean.dim")
def sum_mean_dim(info: OpInfo) -> Iterator[OpStrategy]:
    dims = norm_dims(arg(info.node, "dim"), _ndim(info))
    over = P_SUM if info.node.target.startswith("aten.sum") else P_AVG
    yield from reduce_strategies(info, dims, bool(arg(info.node, "keepdim")), over, True)


@literal_rule("aten.sum.default", "aten.mean.default")
def sum_mean_all(info: OpInfo) -> Iterator[OpStrategy]:
    over = P_SUM if info.node.target.startswith("aten.sum") else P_AVG
    yield from reduce_strategies(info, list(range(_ndim(info))), False, over, True)


@literal_rule("aten.amax.default", "aten.amin.default", "aten.logsumexp.default",
               "aten.any.dim", "aten.all.dim", "aten.any.dims", "aten.all.dims")
def extremum(info: OpInfo) -> Iterator[OpStrategy]:
    """Nonlinear reductions over ``dim``: only the other dims may be split."""
    dims = norm_dims(arg(info.node, "dim"), _ndim(info))
    yield from reduce_strategies(info, dims, bool(arg(info.node, "keepdim")), None, False)


@literal_rule("aten.max.dim", "aten.min.dim", "aten.argmax.default", "aten.argmin.default")
def arg_extremum(info: OpInfo) -> Iterator[OpStrategy]:
    """Values and indices along ``dim`` (None: the flattened tensor, then nothing splits)."""
    dim = arg(info.node, "dim")
    if dim is None:
        return
    dims = norm_dims(dim, _ndim(info))
    yield from reduce_strategies(info, dims, bool(arg(info.node, "keepdim")), None, False)


@literal_rule("aten.linalg_vector_norm.default")
def vector_norm(info: OpInfo) -> Iterator[OpStrategy]:
    """Unreduced dims split. The 2-norm over a split dim is ``P(norm2)``: each rank's norm of
    its shard, whose squares sum to the whole's square (gradient clipping on sharded
    gradients, as FSDP2 computes it); and the 2-norm of a ``P(norm2)`` value is one too
    (the norm of the per-gradient norms). Other orders need the dim whole."""
    dims = norm_dims(arg(info.node, "dim"), _ndim(info))
    two = arg(info.node, "ord") == 2 and all(is_float(m) for m in info.outputs if m)
    yield from reduce_strategies(info, dims, bool(arg(info.node, "keepdim")),
                                 P_NORM2 if two else None, False)
    if two:
        yield _one(info, P_NORM2, P_NORM2)


@literal_rule("aten.var.correction", "aten.std.correction", "aten.var_mean.correction")
def variance(info: OpInfo) -> Iterator[OpStrategy]:
    dims = norm_dims(arg(info.node, "dim"), _ndim(info))
    yield from reduce_strategies(info, dims, bool(arg(info.node, "keepdim")), None, False)


@literal_rule("aten.cumsum.default")
def cumsum(info: OpInfo) -> Iterator[OpStrategy]:
    """A prefix sum along ``dim``: the other dims split; linear, so partials pass."""
    dim = norm_dims(arg(info.node, "dim"), _ndim(info))
    x = info.inputs[0]
    assert x is not None
    for d in shardable(x):
        if d not in dim:
            yield _one(info, Shard(d), Shard(d))
    if is_float(x) and is_float(info.outputs[0]):
        for p in PARTIALS:
            yield _one(info, p, p)


@literal_rule("aten._local_scalar_dense.default", "aten.max.default", "aten.min.default")
def needs_replicate(info: OpInfo) -> Iterator[OpStrategy]:
    """``.item()`` reads the whole value on the host, and a full max has no partial form: the
    input must be replicated (the implied all-Replicate strategy is the only one)."""
    return iter(())
