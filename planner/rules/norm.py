"""Normalization layers: layer norm and batch norm, forward and backward.

Layer norm normalizes over the trailing ``normalized_shape`` dims, so only the leading (batch,
sequence) dims may be split; ``mean`` and ``rstd`` follow. In the backward, the weight and bias
gradients sum over those leading dims and become ``P(sum)`` when they are split; every output
is linear in the incoming gradient, so a partial gradient passes through.

Batch norm in training mode computes statistics over every dim except channels (dim 1), so only
the channel dim may be split; weight, bias, running statistics and saved statistics (all
indexed by channel) split on their dim 0. RMSNorm is traced as pointwise ops and a mean.
"""

from __future__ import annotations

from typing import Iterator

from .._placement import P_SUM, R, Shard
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


def _leading(info: OpInfo, x_name: str) -> list[int]:
    x = tensor_in(info, x_name)
    assert x is not None
    axis = len(x.shape) - len(arg(info.node, "normalized_shape"))
    return [d for d in shardable(x) if d < axis]


@literal_rule("aten.native_layer_norm.default")
def layer_norm(info: OpInfo) -> Iterator[OpStrategy]:
    for d in _leading(info, "input"):
        yield strategy(info, {"input": Shard(d)}, Shard(d))


@literal_rule("aten.native_layer_norm_backward.default")
def layer_norm_backward(info: OpInfo) -> Iterator[OpStrategy]:
    for d in _leading(info, "input"):
        s = Shard(d)
        yield strategy(info, {"grad_out": s, "input": s, "mean": s, "rstd": s}, s, P_SUM, P_SUM)
    if is_float(tensor_in(info, "grad_out")):
        for p in PARTIALS:
            yield strategy(info, {"grad_out": p}, p)


_CHANNEL_STATS = ("weight", "bias", "running_mean", "running_var")


def _channel(info: OpInfo, *extra: str) -> dict:
    """Input split on channels; per-channel tensors on dim 0 (empty placeholders stay R)."""
    spec = {}
    for name in (*_CHANNEL_STATS, *extra):
        m = tensor_in(info, name)
        spec[name] = R if m is not None and m.numel == 0 else Shard(0)
    spec["input"] = Shard(1)
    return spec


def _saved(info: OpInfo, *first: object) -> tuple:
    """Output placements: ``first`` for the leading outputs, Shard(0) for per-channel saved
    statistics, R for the empty placeholders eval mode returns."""
    ps = list(first)
    for m in info.outputs[len(first):]:
        ps.append(R if m is None or m.numel == 0 else Shard(0))
    return outs(info, *ps) if len(ps) > 1 else outs(info, ps[0])


def _channels_split(info: OpInfo) -> bool:
    x = tensor_in(info, "input")
    return x is not None and len(x.shape) >= 2 and x.shape[1] > 1


def _batch_norm(info: OpInfo, training: bool) -> Iterator[OpStrategy]:
    x = tensor_in(info, "input")
    assert x is not None
    if _channels_split(info):
        yield OpStrategy(place(info, _channel(info)), _saved(info, Shard(1)))
    if not training:  # fixed statistics: the op is pointwise over non-channel dims
        for d in shardable(x):
            if d != 1:
                yield OpStrategy(place(info, {"input": Shard(d)}),
                                 outs(info, *[Shard(d)] + [R] * (len(info.outputs) - 1)))


@literal_rule("aten.native_batch_norm.default", "aten._native_batch_norm_legit.default",
               "aten._native_batch_norm_legit_functional.default")
def batch_norm(info: OpInfo) -> Iterator[OpStrategy]:
    yield from _batch_norm(info, bool(arg(info.node, "training")))


@literal_rule("aten._native_batch_norm_legit_no_training.default")
def batch_norm_eval(info: OpInfo) -> Iterator[OpStrategy]:
    yield from _batch_norm(info, False)


@literal_rule("aten._native_batch_norm_legit.no_stats")
def batch_norm_no_stats(info: OpInfo) -> Iterator[OpStrategy]:
    if _channels_split(info):
        yield OpStrategy(place(info, _channel(info)), _saved(info, Shard(1)))


@literal_rule("aten.native_batch_norm_backward.default")
def batch_norm_backward(info: OpInfo) -> Iterator[OpStrategy]:
    """Channel split always; in eval mode (``train`` false) the batch/spatial dims may split too
    (weight and bias gradients then sum over ranks)."""
    x = tensor_in(info, "input")
    assert x is not None
    if _channels_split(info):
        spec = _channel(info, "save_mean", "save_invstd")
        spec["grad_out"] = Shard(1)
        yield strategy(info, spec, Shard(1), Shard(0), Shard(0))
    if not arg(info.node, "train"):
        for d in shardable(x):
            if d != 1:
                s = Shard(d)
                yield strategy(info, {"grad_out": s, "input": s}, s, P_SUM, P_SUM)
    if is_float(tensor_in(info, "grad_out")):
        for p in PARTIALS:
            yield strategy(info, {"grad_out": p}, p)
