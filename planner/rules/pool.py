"""Pooling over the trailing spatial dims: max pooling with indices, average pooling and
adaptive average pooling, forward and backward. (Global average pooling traces to
``mean.dim``, in ``reduction``.)

Pooling windows live in the last 2 (3 for 3-D pooling) dims, so the leading batch and channel
dims may split; the argmax indices are positions within each plane and split alike. Average
pooling is linear, max-pooling's backward is linear in the incoming gradient (a scatter by the
recorded indices): partial values pass through those.
"""

from __future__ import annotations

from typing import Iterator

from .._placement import Shard
from ._registry import OpInfo, OpStrategy
from ._util import PARTIALS, is_float, literal_rule, outs, place, shardable


def _spatial(target: str) -> int:
    return 3 if "3d" in target else 2


def _leading(info: OpInfo, *names: str, linear: bool) -> Iterator[OpStrategy]:
    x = info.inputs[0]
    assert x is not None
    n_lead = len(x.shape) - _spatial(info.node.target)
    for d in shardable(x):
        if d < n_lead:
            yield OpStrategy(place(info, {n: Shard(d) for n in names}), outs(info, Shard(d)))
    if linear and is_float(x):
        for p in PARTIALS:
            yield OpStrategy(place(info, {names[0]: p}), outs(info, p))


@literal_rule("aten.max_pool2d_with_indices.default", "aten.max_pool3d_with_indices.default")
def max_pool(info: OpInfo) -> Iterator[OpStrategy]:
    yield from _leading(info, "self", linear=False)


@literal_rule("aten.max_pool2d_with_indices_backward.default",
               "aten.max_pool3d_with_indices_backward.default")
def max_pool_backward(info: OpInfo) -> Iterator[OpStrategy]:
    yield from _leading(info, "grad_output", "self", "indices", linear=True)


@literal_rule("aten.avg_pool2d.default", "aten.avg_pool3d.default",
               "aten._adaptive_avg_pool2d.default", "aten._adaptive_avg_pool3d.default")
def avg_pool(info: OpInfo) -> Iterator[OpStrategy]:
    yield from _leading(info, "self", linear=True)


@literal_rule("aten.avg_pool2d_backward.default", "aten.avg_pool3d_backward.default",
               "aten._adaptive_avg_pool2d_backward.default",
               "aten._adaptive_avg_pool3d_backward.default")
def avg_pool_backward(info: OpInfo) -> Iterator[OpStrategy]:
    yield from _leading(info, "grad_output", "self", linear=True)
