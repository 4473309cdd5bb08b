"""Ops whose values do not depend on their input's values: ``*_like`` (``ones_like``,
``zeros_like``, ``empty_like``, ``full_like``, ``fill``) and factories (``zeros``, ``ones``,
``full``, ``empty``, ``new_*``, ``scalar_tensor``, ``arange``).

A ``*_like`` output follows a split input (same local shape); from a partial input it is simply
replicated, since the values are known everywhere. Constant factories may produce any split of
their output: the size literal is rewritten to the local shape by ``default_localize``.
``arange`` and ``scalar_tensor`` stay replicated (a split ``arange`` would need a per-rank
start, which a rank-independent local program cannot express).
"""

from __future__ import annotations

from typing import Iterator

from .._placement import R, Shard
from ._registry import OpInfo, OpStrategy, default_localize, sharding_rule
from ._util import PARTIALS, like_input, literal_rule, out0, outs, place, shardable

LIKE = ("aten.ones_like.default", "aten.zeros_like.default", "aten.empty_like.default",
        "aten.full_like.default", "aten.fill.Scalar")
FACTORIES = ("aten.zeros.default", "aten.ones.default", "aten.full.default",
             "aten.empty.memory_format", "aten.new_zeros.default", "aten.new_ones.default",
             "aten.new_full.default", "aten.new_empty.default")
# Their values are unspecified: a validator compares shapes only.
UNINITIALIZED = frozenset({"aten.empty_like.default", "aten.empty.memory_format",
                           "aten.new_empty.default"})


@literal_rule(*LIKE)
def like(info: OpInfo) -> Iterator[OpStrategy]:
    return like_input(info)


NEW = frozenset({"aten.new_zeros.default", "aten.new_ones.default", "aten.new_full.default",
                 "aten.new_empty.default"})


@sharding_rule(*FACTORIES, localize=default_localize)
def factory(info: OpInfo) -> Iterator[OpStrategy]:
    """A constant tensor of a literal size: any split, with the size made local. ``new_*``
    read only their input's dtype and device: it may come in any split, or partial, and is
    not gathered for them (``aux = h.new_zeros(())`` beside a batch-split ``h``)."""
    x = info.inputs[0] if info.node.target in NEW and info.inputs else None
    specs: list[dict] = [{}]
    if x is not None:
        specs += [{"self": Shard(d)} for d in shardable(x)] + [{"self": p} for p in PARTIALS]
    for spec in specs:
        if spec:
            yield OpStrategy(place(info, spec), outs(info, R))
        for d in shardable(out0(info)):
            yield OpStrategy(place(info, spec), outs(info, Shard(d)))


@literal_rule("aten.arange.default", "aten.arange.start", "aten.arange.start_step",
               "aten.scalar_tensor.default")
def replicated_only(info: OpInfo) -> Iterator[OpStrategy]:
    return iter(())
