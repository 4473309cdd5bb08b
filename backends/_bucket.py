"""Gradient bucketing: many small all-reduces become one per bucket, started as soon as the
bucket's last value is ready and waited for where its first reduced value is read, as DDP does.

A lowered program all-reduces each partial value (in a data-parallel plan: every gradient) just
before its first reader. Each call pays the collective's latency; on gloo over loopback that is
~0.1-3 ms, so 70 gradients cost more in latency than in bytes, and a blocking call overlaps
nothing. ``bucket`` rewrites a program: the all-reduces that are a whole redistribution by
themselves (one step, Partial -> Replicate on one axis group, floating dtype) are taken in the
order their values become ready (the index of the instruction that makes the value; program
order among equals), and each joins the open bucket of its group, reduce op and dtype, as in
``kernels.plan_buckets``: a bucket is closed when the value would take it above ``bucket_bytes``
(a value larger than that is a bucket of its own), or when the value is made only after a member
of the bucket is already read (the bucket could not be started before its wait). A bucket
becomes two instructions: ``BucketStart`` right after its last member is made (it copies the
members into one flat buffer and starts the all-reduce, ``Communicator.all_reduce_start``) and
``Bucket`` (the wait) right before the first member's original all-reduce, i.e. before any reader
of a reduced member; the members' own all-reduces no longer run. A one-member bucket whose value
is read before any other op runs stays a blocking all-reduce (there is nothing to overlap).

Readers see the same values: an all-reduce of a concatenation is the concatenation of the
all-reduces (element by element the same sum; with more than two ranks a ring algorithm may add
an element's terms in another order, as DDP's buckets do). Every rank lowers the same program
shape, so every member of a group starts its buckets and its other collectives in the same
order. Lifetimes: a member value is read by the start, which comes before its original
all-reduce and so before its last reader and its ``Free``; the flat buffer belongs to the
pending all-reduce until the wait, which hands out views of the reduced buffer. The reduced
copies live from the wait, which is where the original all-reduce ran.

Layout: each member travels in its memory order and comes back with its strides (a dense
member is packed by one copy, its dimensions permuted to storage order). A traced backward makes
a linear layer's weight gradient as ``t(mm(...))``, a transposed view; read in logical order it
would be copied twice (to flatten it, and again where the update needs it contiguous), and the
reduced copy would reach the update transposed. The element sums are the same either way; every
member of a group runs the same ops on same-shaped pieces, so their members have the same strides
and the flat buffers line up element for element (DDP relies on the same: its buckets are views
laid out as the gradients are).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..ir import Graph, NodeKind, TensorMeta
from ..planner._comm import DEFAULT_BUCKET_BYTES
from ..planner._placement import local_shape



@dataclass(frozen=True, slots=True)
class Bucket:
    """One all-reduce of several values' pieces, flattened into one buffer. In a program this
    is where it is WAITED for (before the first reader of a reduced member); the
    ``BucketStart`` with the same ``index`` started it. Without a start it runs blocking."""

    members: tuple  # tuple[Reshard, ...], each a single all_reduce step over ``group``
    group: tuple[int, ...]
    op: str
    dtype: str
    nbytes: int
    index: int = 0          # pairs it with its BucketStart: buckets are numbered per program


@dataclass(frozen=True, slots=True)
class BucketStart:
    """Starts ``bucket``'s all-reduce (right after its last member was made)."""

    bucket: Bucket


@dataclass(slots=True)
class _Open:
    """A bucket being filled: instruction indices of its members, its bytes, where its start
    and wait go (after ``ready``, before ``wait``)."""

    members: list[int] = field(default_factory=list)
    total: int = 0
    ready: int = -1
    wait: int = 1 << 62


def bucket(instrs: Sequence, graph: Graph, sizes: tuple[int, ...],
           bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list:
    """``instrs`` with mergeable all-reduces merged into buckets: a ``BucketStart`` after the
    last member is made and a ``Bucket`` (the wait) where the first member's all-reduce was."""
    from ._lower import Compute, Reshard

    if bucket_bytes <= 0:
        return list(instrs)
    made_at = {node.name: -1 for node in graph.nodes if node.kind is NodeKind.INPUT}
    made_at.update((ins.node.name, i) for i, ins in enumerate(instrs) if isinstance(ins, Compute))
    # a value the program is given rather than makes (a part of a step: the micro-batches'
    # summed gradients, ``_microbatch.py``) is there from the start, as an input is
    made_at.update((ins.ref.node, -1) for ins in instrs
                   if isinstance(ins, Reshard) and ins.ref.node not in made_at)

    def key(ins: object) -> tuple | None:
        if not (isinstance(ins, Reshard) and len(ins.steps) == 1
                and ins.steps[0].kind == "all_reduce" and ins.ref.node in made_at):
            return None
        meta = graph.meta(ins.ref)
        if not isinstance(meta, TensorMeta) or not getattr(torch, meta.dtype).is_floating_point:
            return None
        s = ins.steps[0]
        if s.src.op.value not in ("sum", "avg"):     # a 2-norm's pieces: squares summed
            return None
        return (s.group, s.src.op.value, meta.dtype)

    def nbytes(ins: Reshard) -> int:
        meta = graph.meta(ins.ref)
        return (math.prod(local_shape(meta.shape, ins.src, sizes))
                * getattr(torch, meta.dtype).itemsize)

    keys = {p: k for p, k in ((p, key(ins)) for p, ins in enumerate(instrs)) if k is not None}
    instrs, keys = defer_readers(instrs, keys)
    made_at.update((ins.node.name, i) for i, ins in enumerate(instrs)  # the new positions
                   if isinstance(ins, Compute))
    ready = sorted(keys, key=lambda p: (made_at[instrs[p].ref.node], p))
    opened: dict[tuple, _Open] = {}
    buckets: list[_Open] = []
    dupes: set[int] = set()
    for p in ready:
        made, size = made_at[instrs[p].ref.node], nbytes(instrs[p])
        b = opened.get(keys[p])
        if b is not None and any((instrs[q].ref, instrs[q].dst) == (instrs[p].ref, instrs[p].dst)
                                 for q in b.members):
            # the same value reduced to the same layout again (``lower`` makes one copy for
            # the forward's readers and one for the later ones, e.g. the loss for the
            # backward's ones_like and for the result): the bucket's copy, made before this
            # position, serves both; reducing it twice in one bucket wrote one copy twice
            dupes.add(p)
            continue
        if b is not None and (made >= b.wait or (b.total and b.total + size > bucket_bytes)):
            b = None
        if b is None:
            b = opened[keys[p]] = _Open()
            buckets.append(b)
        b.members.append(p)
        b.total += size
        b.ready, b.wait = max(b.ready, made), min(b.wait, p)
    computes = [i for i, ins in enumerate(instrs) if isinstance(ins, Compute)]
    starts: dict[int, list] = {}         # instruction index -> the starts that follow it
    waits: dict[int, Bucket] = {}        # instruction index -> the wait that replaces it
    merged: set[int] = set()
    for b in buckets:
        if len(b.members) == 1 and not _work_between(computes, b.ready, b.wait):
            continue
        k = keys[b.members[0]]
        made = Bucket(tuple(instrs[p] for p in sorted(b.members)), k[0], k[1], k[2], b.total,
                      len(waits))
        starts.setdefault(b.ready, []).append(BucketStart(made))
        waits[b.wait] = made
        merged.update(b.members)
    out: list = list(starts.get(-1, ()))
    for p, ins in enumerate(instrs):
        if p in waits:
            out.append(waits[p])
        elif p not in merged and p not in dupes:
            out.append(ins)
        out.extend(starts.get(p, ()))
    return out


def defer_readers(instrs: Sequence, keys: dict[int, tuple]) -> tuple[list, dict[int, tuple]]:
    """Move what reads a mergeable all-reduce's result (and all that depends on it) after
    everything else, so that the all-reduce can run behind the rest of the step.

    A traced step interleaves gradient clipping (a norm per gradient) and views of gradients
    with the backward, so each gradient's reduced value is read right after it is made. An
    all-reduce whose dependents include no other mergeable all-reduce (a gradient's; not the
    loss's, which feeds the whole backward) is deferred with all its dependents: they keep
    their order, after every other instruction, which keeps theirs (nothing else depends on
    them, and they only read values made before). ``Free``s are placed again after each name's
    last reader in the new order. Returns the instructions and ``keys`` (candidate index ->
    bucket key) renumbered; unchanged when nothing is deferred."""
    from ._lower import Compute, Free, Reshard

    bit = {p: 1 << n for n, p in enumerate(keys)}
    made: dict[str, int] = {}                       # node name -> the seeds it depends on
    copied: dict[tuple, int] = {}                   # (node, index, layout) -> the same
    dep = [0] * len(instrs)
    for j, ins in enumerate(instrs):
        if isinstance(ins, Reshard):
            dep[j] = made.get(ins.ref.node, 0) | bit.get(j, 0)
            copied[(ins.ref.node, ins.ref.index, ins.dst)] = dep[j]
        elif isinstance(ins, Compute):
            for r, layout in zip(ins.node.refs(), ins.reads):
                dep[j] |= copied.get((r.node, r.index, layout), made.get(r.node, 0))
            made[ins.node.name] = dep[j]
    inside = 0
    for p in keys:
        inside |= dep[p] & ~bit[p]                  # seeds that another candidate depends on
    seeds = sum(b for p, b in bit.items() if not b & inside)
    later = [j for j in range(len(instrs)) if dep[j] & seeds]
    if not later or len(later) == len(instrs):
        return list(instrs), keys
    deferred = set(later)
    order = [j for j, ins in enumerate(instrs)
             if j not in deferred and not isinstance(ins, Free)] + later
    last: dict[str, int] = {}                       # name -> its last reader's new position
    for at, j in enumerate(order):
        ins = instrs[j]
        names = ([r.node for r in ins.node.refs()] if isinstance(ins, Compute)
                 else [ins.ref.node])
        for name in names:
            last[name] = at
    frees: dict[int, list[str]] = {}
    for ins in instrs:
        if isinstance(ins, Free):
            for name in ins.names:
                frees.setdefault(last.get(name, len(order) - 1), []).append(name)
    out: list = []
    new_keys: dict[int, tuple] = {}
    for at, j in enumerate(order):
        if j in keys:
            new_keys[len(out)] = keys[j]
        out.append(instrs[j])
        if at in frees:
            out.append(Free(tuple(frees[at])))
    return out, new_keys


def _work_between(computes: list[int], after: int, before: int) -> bool:
    """Whether a ``Compute`` lies strictly between instruction indices ``after`` and ``before``
    (``computes``: the sorted indices of the computes)."""
    i = bisect.bisect_right(computes, after)
    return i < len(computes) and computes[i] < before


class PendingBucket:
    """A bucket's all-reduce in flight; ``wait()`` returns the reduced pieces (views of one
    buffer, shaped and laid out as the values that went in). It holds the flat buffer until then."""

    __slots__ = ("_pending", "_layouts")

    def __init__(self, pending: object,
                 layouts: list[tuple[torch.Size, tuple[int, ...]]]) -> None:
        self._pending, self._layouts = pending, layouts

    def wait(self) -> list[Tensor]:
        return split_bucket(self._pending.wait(), self._layouts)


def pending_name(b: Bucket) -> str:
    """The name a running program keeps ``b``'s pending all-reduce under between its start and
    its wait (no graph node has it)."""
    return f"<bucket {b.index}>"


def storage_order(t: Tensor) -> tuple[int, ...]:
    """The permutation of ``t``'s dimensions that makes it contiguous when ``t`` is dense in
    some order (a transposed weight gradient: ``(1, 0)``); the identity otherwise. Size-1
    dimensions keep their place (their stride is arbitrary)."""
    dims = tuple(range(t.dim()))
    if t.is_contiguous():
        return dims
    perm = tuple(sorted(dims, key=lambda d: (-t.stride(d) if t.shape[d] > 1 else 0, d)))
    return perm if t.permute(perm).is_contiguous() else dims


def start_bucket(b: Bucket, values: Sequence[Tensor], comm: object) -> PendingBucket:
    """Start the all-reduce of ``values`` (this rank's pieces, in member order) as one buffer
    (``comm.all_reduce_start``, which may reduce in it); the values may be freed once this
    returns."""
    orders = [storage_order(v) for v in values]
    flat = torch.cat([v.permute(o).reshape(-1) for v, o in zip(values, orders)])
    return PendingBucket(comm.all_reduce_start(flat, b.group, b.op, donate=True),
                         [(v.shape, o) for v, o in zip(values, orders)])


def split_bucket(reduced: Tensor, layouts: Sequence[tuple[torch.Size, tuple[int, ...]]]
                 ) -> list[Tensor]:
    """The pieces of a reduced flat buffer: views shaped as each ``(shape, order)``'s shape,
    laid out in ``order`` (``storage_order`` of the value that went in)."""
    out, at = [], 0
    for shape, order in layouts:
        n = math.prod(shape)
        piece = reduced[at:at + n].view([shape[d] for d in order])
        out.append(piece.permute(sorted(range(len(order)), key=order.__getitem__)))
        at += n
    return out


def run_bucket(b: Bucket, values: Sequence[Tensor], comm: object) -> list[Tensor]:
    """All-reduce ``values`` (this rank's pieces, in member order) as one buffer, started and
    waited for at once; returns the reduced pieces (views of one new buffer)."""
    return start_bucket(b, values, comm).wait()


__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "BucketStart", "PendingBucket", "bucket",
           "pending_name", "run_bucket", "split_bucket", "start_bucket", "storage_order"]
