"""Embedding lookup and its dense backward.

``embedding(weight [V, D], indices [*]) -> [*, D]``: split indices give outputs split on the
same dim; a weight split on the embedding dim (dim 1) gives outputs split on the last dim. A
weight split on the vocabulary (dim 0) would need masking of out-of-range ids, which the plain
op does not do, so it is not offered. The lookup is linear in the weight: partials pass.

``embedding_dense_backward(grad [*, D], indices [*]) -> [V, D]`` scatter-adds rows: split
indices (with the gradient split alike) give a ``P(sum)`` weight gradient, unless
``scale_grad_by_freq`` needs global counts; a gradient split on its last dim gives a weight
gradient split on dim 1.
"""

from __future__ import annotations

from typing import Iterator

from .._placement import P_SUM, Shard
from ._registry import OpInfo, OpStrategy
from ._util import PARTIALS, arg, is_float, literal_rule, out0, shardable, strategy, tensor_in


@literal_rule("aten.embedding.default")
def embedding(info: OpInfo) -> Iterator[OpStrategy]:
    idx, w = tensor_in(info, "indices"), tensor_in(info, "weight")
    assert idx is not None and w is not None
    for d in shardable(idx):
        yield strategy(info, {"indices": Shard(d)}, Shard(d))
    if w.shape[1] > 1:
        yield strategy(info, {"weight": Shard(1)}, Shard(len(out0(info).shape) - 1))
    if is_float(w):
        for p in PARTIALS:
            yield strategy(info, {"weight": p}, p)


@literal_rule("aten.embedding_dense_backward.default")
def embedding_backward(info: OpInfo) -> Iterator[OpStrategy]:
    g, idx = tensor_in(info, "grad_output"), tensor_in(info, "indices")
    assert g is not None and idx is not None
    if not arg(info.node, "scale_grad_by_freq"):
        for d in shardable(idx):
            yield strategy(info, {"grad_output": Shard(d), "indices": Shard(d)}, P_SUM)
    if g.shape[-1] > 1:
        yield strategy(info, {"grad_output": Shard(len(g.shape) - 1)}, Shard(1))
    if is_float(g):
        for p in PARTIALS:
            yield strategy(info, {"grad_output": p}, p)
