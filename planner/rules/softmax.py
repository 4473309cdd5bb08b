"""Softmax and log-softmax, forward and backward (``_softmax``, ``_log_softmax``,
``_safe_softmax`` and their ``*_backward_data`` ops).

The op normalizes along ``dim``; every other dim may be split. The backward ops are linear in
the incoming gradient (for softmax ``y * (g - sum(g * y))``, for log-softmax
``g - exp(y) * sum(g)``), so a partial gradient with a replicated output passes through.
"""

from __future__ import annotations

from typing import Iterator

from .._placement import Shard
from ._registry import OpInfo, OpStrategy
from ._util import PARTIALS, arg, is_float, literal_rule, norm_dim, shardable, strategy, tensor_in


@literal_rule("aten._softmax.default", "aten._log_softmax.default", "aten._safe_softmax.default")
def softmax(info: OpInfo) -> Iterator[OpStrategy]:
    x = tensor_in(info, "self")
    assert x is not None
    dim = norm_dim(arg(info.node, "dim"), len(x.shape))
    for d in shardable(x):
        if d != dim:
            yield strategy(info, {"self": Shard(d)}, Shard(d))


@literal_rule("aten._softmax_backward_data.default", "aten._log_softmax_backward_data.default")
def softmax_backward(info: OpInfo) -> Iterator[OpStrategy]:
    g = tensor_in(info, "grad_output")
    assert g is not None
    dim = norm_dim(arg(info.node, "dim"), len(g.shape))
    for d in shardable(g):
        if d != dim:
            yield strategy(info, {"grad_output": Shard(d), "output": Shard(d)}, Shard(d))
    if is_float(g):
        for p in PARTIALS:
            yield strategy(info, {"grad_output": p}, p)
