"""Gradient bucketing: many small all-reduces become one per bucket, the way DDP buckets.

A lowered program all-reduces each partial value (in a data-parallel plan: every gradient) just
before its first reader. Each call pays the collective's latency; on gloo over loopback that is
~0.1-3 ms, so 70 gradients cost more in latency than in bytes. ``bucket`` rewrites a program:
an all-reduce that is a whole redistribution by itself (one step, Partial -> Replicate on one
axis group) is merged with the LATER such all-reduces of the same group, reduce op and dtype
whose values already exist at that point, in program order, up to ``bucket_bytes`` per bucket
(a value larger than that is a bucket of its own). The merged call runs where the first member
was; the others no longer run where they were. Readers see the same values: an all-reduce of a
concatenation is the concatenation of the all-reduces (element by element the same sum; with
more than two ranks a ring algorithm may add an element's terms in another order, as DDP's
buckets do).

Moving a member earlier only extends how long its reduced copy lives (by the distance it
moved); values are never consumed before the bucket since their readers come after their
original position.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..ir import Graph, NodeKind, TensorMeta
from ..planner._placement import local_shape

DEFAULT_BUCKET_BYTES = 25 << 20        # DDP's bucket_cap_mb default


@dataclass(frozen=True, slots=True)
class Bucket:
    """One all-reduce of several values' pieces, flattened into one buffer."""

    members: tuple  # tuple[Reshard, ...], each a single all_reduce step over ``group``
    group: tuple[int, ...]
    op: str
    dtype: str
    nbytes: int


def bucket(instrs: Sequence, graph: Graph, sizes: tuple[int, ...],
           bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list:
    """``instrs`` with mergeable all-reduces merged into ``Bucket`` instructions."""
    from ._lower import Compute, Reshard

    if bucket_bytes <= 0:
        return list(instrs)
    made_at: dict[str, int] = {}         # node name -> index of the instruction that makes it
    for i, ins in enumerate(instrs):
        if isinstance(ins, Compute):
            made_at[ins.node.name] = i
    for node in graph.nodes:
        if node.kind is NodeKind.INPUT:
            made_at[node.name] = -1

    def key(ins: object) -> tuple | None:
        if not (isinstance(ins, Reshard) and len(ins.steps) == 1
                and ins.steps[0].kind == "all_reduce"):
            return None
        meta = graph.meta(ins.ref)
        if not isinstance(meta, TensorMeta) or not getattr(torch, meta.dtype).is_floating_point:
            return None
        s = ins.steps[0]
        return (s.group, s.src.op.value, meta.dtype)

    def nbytes(ins: Reshard) -> int:
        meta = graph.meta(ins.ref)
        return (math.prod(local_shape(meta.shape, ins.src, sizes))
                * getattr(torch, meta.dtype).itemsize)

    keys = [key(ins) for ins in instrs]
    taken: set[int] = set()
    out: list = []
    for p, ins in enumerate(instrs):
        if p in taken:
            continue
        k = keys[p]
        if k is None:
            out.append(ins)
            continue
        members, total = [ins], nbytes(ins)
        for j in range(p + 1, len(instrs)):
            if keys[j] != k or j in taken or total >= bucket_bytes:
                continue
            other = instrs[j]
            size = nbytes(other)
            if made_at.get(other.ref.node, len(instrs)) < p and total + size <= bucket_bytes:
                members.append(other)
                total += size
                taken.add(j)
        if len(members) == 1:
            out.append(ins)
        else:
            out.append(Bucket(tuple(members), k[0], k[1], k[2], total))
    return out


def run_bucket(b: Bucket, values: Sequence[Tensor], comm: object) -> list[Tensor]:
    """All-reduce ``values`` (this rank's pieces, in member order) as one buffer; returns the
    reduced pieces (views of one new buffer)."""
    flat = torch.cat([v.reshape(-1) for v in values])
    reduced = comm.all_reduce(flat, b.group, b.op)
    out, at = [], 0
    for v in values:
        n = v.numel()
        out.append(reduced[at:at + n].view(v.shape))
        at += n
    return out


__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "bucket", "run_bucket"]
