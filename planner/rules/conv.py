"""Convolution forward and backward (``convolution``, ``convolution_backward``).

For an ordinary convolution (``groups == 1``, not transposed), like a matmul over channels:
split the batch (dim 0) of input and output; split output channels (weight and bias dim 0,
output dim 1); or split input channels (input dim 1, weight dim 1), each rank then holds a
partial sum of the output (the bias, if any, enters as a partial value itself). Grouped and
transposed convolutions split the batch only. Convolution is linear in input and bias: partial
inputs pass. The backward mirrors these: a split batch makes weight and bias gradients
``P(sum)``; split output channels make the input gradient ``P(sum)``; split input channels leave
the bias gradient replicated. ``bias_sizes`` is localized to the local bias shape.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from ...ir import Node
from .._placement import P_SUM, R, Shard
from ._registry import OpInfo, OpStrategy, Shape, sharding_rule
from ._util import PARTIALS, arg, arg_names, is_float, literal_rule, outs, strategy, tensor_in


def _plain(info: OpInfo) -> bool:
    return arg(info.node, "groups") == 1 and not arg(info.node, "transposed")


def _splits(info: OpInfo, name: str, d: int) -> bool:
    m = tensor_in(info, name)
    return m is not None and m.shape[d] > 1


@literal_rule("aten.convolution.default")
def convolution(info: OpInfo) -> Iterator[OpStrategy]:
    if _splits(info, "input", 0):
        yield strategy(info, {"input": Shard(0)}, Shard(0))
    if _plain(info):
        if _splits(info, "weight", 0):
            yield strategy(info, {"weight": Shard(0), "bias": Shard(0)}, Shard(1))
        if _splits(info, "input", 1):
            yield strategy(info, {"input": Shard(1), "weight": Shard(1), "bias": P_SUM}, P_SUM)
    if is_float(tensor_in(info, "input")):
        for p in PARTIALS:
            yield strategy(info, {"input": p, "bias": p}, p)


def localize_bias_sizes(node: Node, ins: Sequence[Shape | None],
                        outs_: Sequence[Shape | None]) -> tuple[tuple, tuple]:
    i = arg_names(node.target).index("bias_sizes")
    args = list(node.args)
    if i < len(args) and outs_[2] is not None:
        args[i] = tuple(outs_[2])
    return tuple(args), node.kwargs


@sharding_rule("aten.convolution_backward.default", localize=localize_bias_sizes)
def convolution_backward(info: OpInfo) -> Iterator[OpStrategy]:
    if _splits(info, "input", 0):
        yield OpStrategy(strategy(info, {"grad_output": Shard(0), "input": Shard(0)}).inputs,
                         outs(info, Shard(0), P_SUM, P_SUM))
    if _plain(info):
        if _splits(info, "weight", 0):
            s = strategy(info, {"grad_output": Shard(1), "weight": Shard(0)})
            yield OpStrategy(s.inputs, outs(info, P_SUM, Shard(0), Shard(0)))
        if _splits(info, "input", 1):
            s = strategy(info, {"input": Shard(1), "weight": Shard(1)})
            yield OpStrategy(s.inputs, outs(info, Shard(1), Shard(1), R))
    if is_float(tensor_in(info, "grad_output")):
        for p in PARTIALS:
            yield strategy(info, {"grad_output": p}, p)
