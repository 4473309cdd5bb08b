"""Random ops: dropout's ``bernoulli`` (``nn.Dropout``, ``F.dropout`` and attention's math path
trace to ``bernoulli.p`` on an ``empty_like``), ``bernoulli(probs)``, ``rand_like`` /
``randn_like`` / ``randint_like``, and the factories ``rand`` / ``randn``.

A split output is drawn on each rank for its own piece: the runtime seeds each rank's generator
from its coordinates on the axes that shard the output (``backends/_rng.py``), so shards draw
independent values and replicas equal ones. The values are never those of one process, so the
check of these rules compares shapes only. An output is never ``Partial``: a random draw split
into summands means nothing. ``bernoulli.p`` and the ``*_like`` ops read only their input's
shape, so a partial input gives a replicated output, as ``creation.py``'s ``*_like`` ops do;
``bernoulli(probs)`` reads the probabilities, elementwise, so they split with the output.
"""

from __future__ import annotations

from typing import Iterator

from .._placement import Shard
from ._registry import OpInfo, OpStrategy, default_localize, sharding_rule
from ._util import like_input, out0, outs, place, shardable

SHAPE_ONLY = ("aten.bernoulli.p", "aten.rand_like.default", "aten.randn_like.default",
              "aten.randint_like.default", "aten.randint_like.low_dtype")
FACTORIES = ("aten.rand.default", "aten.randn.default")
RANDOM = frozenset({*SHAPE_ONLY, "aten.bernoulli.default", *FACTORIES})


@sharding_rule(*SHAPE_ONLY, family="random")
def shape_only(info: OpInfo) -> Iterator[OpStrategy]:
    return like_input(info)


@sharding_rule("aten.bernoulli.default", family="random")
def bernoulli_probs(info: OpInfo) -> Iterator[OpStrategy]:
    x = info.inputs[0]
    assert x is not None
    for d in shardable(x):
        yield OpStrategy(place(info, {"self": Shard(d)}), outs(info, Shard(d)))


@sharding_rule(*FACTORIES, localize=default_localize, family="random")
def factory(info: OpInfo) -> Iterator[OpStrategy]:
    """Random values of a literal size: any split, each rank drawing its local size."""
    for d in shardable(out0(info)):
        yield OpStrategy(place(info, {}), outs(info, Shard(d)))
