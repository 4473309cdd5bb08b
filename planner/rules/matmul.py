"""Matrix products: mm, addmm, bmm, baddbmm (one mesh axis each).

The three ways to split ``C = A @ B``: rows of A (C sharded on rows), columns of B (C sharded on
columns), or the contraction dim (every rank holds a partial C to be summed).
"""

from __future__ import annotations

from typing import Iterator

from .._placement import P_SUM, R, Shard
from ._registry import OpInfo, OpStrategy, sharding_rule


@sharding_rule("aten.mm.default")
def mm(info: OpInfo) -> Iterator[OpStrategy]:
    yield OpStrategy((Shard(0), R), (Shard(0),))
    yield OpStrategy((R, Shard(1)), (Shard(1),))
    yield OpStrategy((Shard(1), Shard(0)), (P_SUM,))


@sharding_rule("aten.addmm.default")
def addmm(info: OpInfo) -> Iterator[OpStrategy]:
    """``bias + a @ b`` with ``bias`` broadcast from [n] or [1, n] or given as [m, n]."""
    bias = info.inputs[0]
    assert bias is not None
    full = len(bias.shape) == 2 and bias.shape[0] != 1
    col_dim = len(bias.shape) - 1
    yield OpStrategy((Shard(0) if full else R, Shard(0), R), (Shard(0),))
    yield OpStrategy((Shard(col_dim), R, Shard(1)), (Shard(1),))
    # partial sums: the bias enters once, as a partial value itself
    yield OpStrategy((P_SUM, Shard(1), Shard(0)), (P_SUM,))


@sharding_rule("aten.bmm.default")
def bmm(info: OpInfo) -> Iterator[OpStrategy]:
    yield OpStrategy((Shard(0), Shard(0)), (Shard(0),))
    yield OpStrategy((Shard(1), R), (Shard(1),))
    yield OpStrategy((R, Shard(2)), (Shard(2),))
    yield OpStrategy((Shard(2), Shard(1)), (P_SUM,))


@sharding_rule("aten.baddbmm.default")
def baddbmm(info: OpInfo) -> Iterator[OpStrategy]:
    """``beta * bias + alpha * a @ b``; bias is [b, m, n] (possibly broadcast from size-1 dims)."""
    bias = info.inputs[0]
    assert bias is not None
    def along(d: int) -> Shard | type(R):  # bias sharded only where it is not broadcast
        return Shard(d) if bias.shape[d] != 1 else R
    yield OpStrategy((along(0), Shard(0), Shard(0)), (Shard(0),))
    yield OpStrategy((along(1), Shard(1), R), (Shard(1),))
    yield OpStrategy((along(2), R, Shard(2)), (Shard(2),))
    yield OpStrategy((P_SUM, Shard(2), Shard(1)), (P_SUM,))
