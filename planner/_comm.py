"""Alpha-beta cost of collectives on one mesh axis, and of changing a tensor's layout.

Ring algorithms on ``n`` ranks; ``nbytes`` is the size of the full (unsharded along this axis)
buffer the collective produces or consumes. An all-reduce is a reduce-scatter plus an
all-gather. These are the textbook bus-bandwidth formulas NCCL's own performance notes use.
"""

from __future__ import annotations

import enum
import math

from .._errors import PlanError
from ._mesh import Link
from ._placement import Partial, Placement, ReduceOp, Replicate, Shard


class Collective(enum.Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"
    BROADCAST = "broadcast"


def collective_time(kind: Collective, nbytes: float, n: int, link: Link) -> float:
    """Seconds for one collective over ``n`` ranks moving a ``nbytes`` buffer: the ring's
    alpha-beta time, plus the link's ``wait`` once per call (busy members being scheduled)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    b, a = link.for_kind(kind.value)
    frac = (n - 1) / n
    w = link.wait
    if kind is Collective.ALL_REDUCE:
        return w + 2 * (n - 1) * a + 2 * frac * nbytes / b
    if kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return w + (n - 1) * a + frac * nbytes / b
    if kind is Collective.SEND_RECV:
        return w + a + nbytes / b
    if kind is Collective.BROADCAST:
        return w + (n - 1) * a + nbytes / b      # pipelined ring
    raise PlanError(f"unknown collective {kind}")


DEFAULT_BUCKET_BYTES = 25 << 20        # DDP's bucket_cap_mb default: the lowering's cap when a
                                       # plan chose none
BUCKET_SIZES: tuple[int, ...] = tuple(1 << k for k in range(18, 31))   # 256 KiB .. 1 GiB


def bucket_time(bucket_bytes: int, total_bytes: float, n: int, link: Link,
                overlap: float) -> float:
    """Seconds a step is held up by all-reducing ``total_bytes`` of gradients in buckets of
    ``bucket_bytes`` over ``n`` ranks, when a fraction ``overlap`` of collective time can run
    under compute: every bucket pays the ring's latency; the bytes cost their bandwidth time,
    of which ``overlap`` hides under backward except for the last bucket's (it starts only
    once backward has made its last gradient)."""
    if n <= 1 or total_bytes <= 0:
        return 0.0
    buckets = math.ceil(total_bytes / bucket_bytes)
    bandwidth, alpha = link.for_kind(Collective.ALL_REDUCE.value)
    latency = link.wait + 2 * (n - 1) * alpha       # collective_time's, per call
    wire = lambda b: 2 * (n - 1) / n * b / bandwidth   # noqa: E731 - and per byte
    last = min(bucket_bytes, total_bytes)
    return buckets * latency + (1 - overlap) * wire(total_bytes) + overlap * wire(last)


def bucket_call_time(nbytes: float, n: int, link: Link, hidden: float) -> float:
    """Seconds one bucket's all-reduce of ``nbytes`` over ``n`` ranks holds a step up when a
    fraction ``hidden`` of its wire time runs under compute (its latency and wait never do)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, _ = link.for_kind(Collective.ALL_REDUCE.value)
    return (collective_time(Collective.ALL_REDUCE, nbytes, n, link)
            - hidden * 2 * (n - 1) / n * nbytes / bandwidth)


def best_bucket_bytes(total_bytes: float, n: int, link: Link, overlap: float) -> int:
    """The bucket size (one of ``BUCKET_SIZES``) with the least ``bucket_time``; among equals
    the one with fewer buckets, then the smaller (less memory for the same calls). Without
    overlap that is one bucket for everything (each extra bucket only adds latency); with full
    overlap it is near ``sqrt(total * latency * bandwidth)``, where one more bucket's latency
    equals the bandwidth time the smaller last bucket saves."""
    return min(BUCKET_SIZES, key=lambda b: (bucket_time(b, total_bytes, n, link, overlap),
                                            math.ceil(total_bytes / b), b))


def _norm2(p: Placement) -> bool:
    return isinstance(p, Partial) and p.op is ReduceOp.NORM2


def transition(src: Placement, dst: Placement) -> Collective | None | bool:
    """The collective that turns ``src`` into ``dst`` along one axis: a Collective, None when
    it is free (a local slice, or keeping a value as one rank's partial), or False when the
    change is not allowed."""
    if src == dst:
        return None
    if _norm2(src) or _norm2(dst):
        if isinstance(src, Replicate):            # R -> P(norm2): coordinate 0 keeps the value,
            return None                           # the others hold zero (the norm of the pieces)
        return Collective.ALL_REDUCE if isinstance(dst, Replicate) else False  # only to whole
    if isinstance(src, Replicate):
        return None                               # R -> S: local slice; R -> P: keep on rank 0
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return Collective.ALL_GATHER
        if isinstance(dst, Shard):
            return Collective.ALL_TO_ALL
        return False                              # S -> P is never useful
    assert isinstance(src, Partial)
    if isinstance(dst, Replicate):
        return Collective.ALL_REDUCE
    if isinstance(dst, Shard):
        return Collective.REDUCE_SCATTER
    return False                                  # P(sum) <-> P(avg): not modelled
