"""Freeing as FSDP2 frees: a partial sum read only reduced to a smaller layout is reduced as
soon as it is made and its unreduced original dropped (``reduce_early``); a value's copy in
another layout is dropped after its last reader (``free_copies``).

A lowered program changes a value's layout just before the first reader that needs the new
layout. For a gradient under FSDP (made whole-sized and partial on every rank by the backward,
read sharded by the optimizer) that puts every reduce-scatter at the optimizer: each full-sized
partial gradient lives through the rest of the backward, which on a 70B model is the whole
model's gradients on every device. FSDP2 instead reduce-scatters each layer's gradients as soon
as the backward makes them. ``reduce_early`` does the same for any value: a ``Reshard`` whose
source layout has a partial axis and whose result is smaller on this rank than its source moves
to right after the instruction that makes the value (an op or a kernel call). When nothing reads
the original afterwards (no op or kernel reads it in its own layout, no other redistribution or
bucket starts from it, it is not returned as it is), a ``Drop`` right after the last instruction
that does releases it. The same holds for a partial value all-reduced in a bucket
(``_bucket.py``): the bucket's start copies it into a buffer of its own, so its original is
dropped after the last instruction that reads it unreduced, usually that start (a data-parallel
gradient is not held twice, unreduced and reduced, through the rest of the backward).

A copy (a gathered parameter, say) otherwise stays until its value's ``Free``, i.e. after the
value's last reader in any layout: a parameter gathered for the forward would be held until
the optimizer reads its shard. ``free_copies`` drops each copy after its last reader; the
lowering makes a copy once for the forward's readers and once for the later ones
(``_lower.lower``), so a parameter is gathered again for the backward as FSDP2 does with
``reshard_after_forward``.

Every rank runs the same passes on the same program shape, so collectives keep one order
across ranks. Readers see the same values: a redistribution reads only its value, which is
complete where it was made. The planner's memory model (``planner._solve``: ``_Held``,
``peak_memory``, ``Problem.early_values``) counts such a value at its full size only where it
is made and its reduced copy from there to its last reader, and every other copy from its
first reader to its last, once for the forward and once for the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..ir import Graph, Ref, TensorMeta
from ..planner._problem import has_partial, shrinks


@dataclass(frozen=True, slots=True)
class Drop:
    """Release these values in one layout each: ``(value, None)`` its original (the copies
    stay; ``reduce_early``), ``(value, layout)`` its copy in that layout (``free_copies``)."""

    items: tuple[tuple[Ref, object], ...]


def reduce_early(instrs: Sequence, graph: Graph, sizes: tuple[int, ...],
                 tail_reads: Iterable[tuple[Ref, object]] = ()) -> list:
    """``instrs`` with shrinking reductions of partial values moved to where the value is made,
    and a ``Drop`` of each original nothing reads after that. ``tail_reads``: ``(value,
    layout)`` read after the last instruction (the step's new state and results)."""
    from ._bucket import Bucket, BucketStart
    from ._kernels import KernelCall
    from ._lower import Compute, Reshard

    made_at: dict[Ref, int] = {}
    for i, ins in enumerate(instrs):
        if isinstance(ins, Compute):
            for k in range(len(ins.node.outputs)):
                made_at[Ref(ins.node.name, k)] = i
        elif isinstance(ins, KernelCall):
            for member in ins.results:
                for _, ref, _ in member:
                    made_at[ref] = i
    moved: dict[int, list[int]] = {}          # instruction index -> reshards moved after it
    moving: set[int] = set()
    for i, ins in enumerate(instrs):
        if not (isinstance(ins, Reshard) and ins.ref in made_at and made_at[ins.ref] < i):
            continue
        meta = graph.meta(ins.ref)
        if (isinstance(meta, TensorMeta) and getattr(torch, meta.dtype).is_floating_point
                and shrinks(ins.src, ins.dst, sizes)):   # the planner's test: both agree
            moved.setdefault(made_at[ins.ref], []).append(i)
            moving.add(i)
    reduced = {(instrs[i].ref, instrs[i].dst) for i in moving}
    candidates = {instrs[i].ref: instrs[i].src for i in moving}
    # an all-reduce in a bucket does not shrink its value, but a started bucket holds its
    # members in a buffer of its own (``start_bucket``): an original nothing else reads is
    # dropped there, not kept to its value's ``Free`` beside the reduced copy (a data-parallel
    # gradient held twice through the rest of the backward and the optimizer)
    started = {ins.bucket.index for ins in instrs if isinstance(ins, BucketStart)}
    for ins in instrs:
        if isinstance(ins, BucketStart):
            for m in ins.bucket.members:
                meta = graph.meta(m.ref)
                if (isinstance(meta, TensorMeta) and has_partial(m.src)
                        and getattr(torch, meta.dtype).is_floating_point):
                    candidates.setdefault(m.ref, m.src)
                    reduced.add((m.ref, m.dst))
    if not candidates:
        return list(instrs)

    # where the original of each candidate is last read (in the order after the move)
    order = [j for i in range(len(instrs)) if i not in moving
             for j in (i, *moved.get(i, ()))]
    last: dict[Ref, int] = {}

    def original(ref: Ref, layout: object) -> bool:
        return ref in candidates and (ref, layout) not in reduced

    for at, i in enumerate(order):
        ins = instrs[i]
        if isinstance(ins, Compute):
            hits = [r for r, l in zip(ins.node.refs(), ins.reads) if original(r, l)]
        elif isinstance(ins, KernelCall):
            hits = [r for member in ins.operands for _, r, l in member
                    if isinstance(r, Ref) and original(r, l)]
            hits += [r for r in ins.attr_refs if r in candidates]
        elif isinstance(ins, Reshard):
            hits = [ins.ref] if ins.ref in candidates else []
        elif isinstance(ins, BucketStart) or (isinstance(ins, Bucket)
                                              and ins.index not in started):
            members = ins.members if isinstance(ins, Bucket) else ins.bucket.members
            hits = [m.ref for m in members if m.ref in candidates]
        else:
            hits = []
        for r in hits:
            last[r] = at
    kept = {r for r, layout in tail_reads if original(r, layout)}
    drops: dict[int, list[Ref]] = {}
    for ref in candidates:
        if ref not in kept and ref in last:
            drops.setdefault(last[ref], []).append(ref)
    out: list = []
    for at, i in enumerate(order):
        out.append(instrs[i])
        if at in drops:
            out.append(Drop(tuple((r, None) for r in drops[at])))
    return out


def free_copies(instrs: Sequence, tail_reads: Iterable[tuple[Ref, object]] = ()) -> list:
    """``instrs`` with a ``Drop`` of each copy (a value changed into another layout by a
    ``Reshard`` or a ``Bucket``) right after its last reader, where it would otherwise stay
    until its value's ``Free``: a parameter gathered for the forward is not held through the
    backward, an activation's gathered copy not until its value's last reader. A copy made
    again later (the backward's own gather, ``lower``) is a new one with its own readers.
    ``tail_reads``: ``(value, layout)`` read after the last instruction (kept)."""
    from ._bucket import Bucket
    from ._kernels import KernelCall
    from ._lower import Compute, Free, Reshard

    live: dict[tuple[Ref, object], int] = {}     # copy -> its last reader (or its maker) so far
    ends: dict[int, list[tuple[Ref, object]]] = {}

    def close(key: tuple[Ref, object]) -> None:
        ends.setdefault(live.pop(key), []).append(key)

    for i, ins in enumerate(instrs):
        if isinstance(ins, Compute):
            for r, layout in zip(ins.node.refs(), ins.reads):
                if (r, layout) in live:
                    live[(r, layout)] = i
        elif isinstance(ins, KernelCall):
            for member in ins.operands:
                for _, r, layout in member:
                    if (r, layout) in live:
                        live[(r, layout)] = i
        elif isinstance(ins, (Reshard, Bucket)):
            members = ins.members if isinstance(ins, Bucket) else (ins,)
            for key in dict.fromkeys((m.ref, m.dst) for m in members):   # one copy per key:
                if key in live:             # a key twice in one bucket dropped its own copy
                    close(key)
                live[key] = i
        elif isinstance(ins, Free):
            names = set(ins.names)
            for key in [k for k in live if k[0].node in names]:
                close(key)                       # dropped after its last reader, if earlier
    for key in set(tail_reads):
        live.pop(key, None)
    for key in list(live):
        close(key)
    out: list = []
    for i, ins in enumerate(instrs):
        out.append(ins)
        gone = ends.get(i)
        if gone:
            after = instrs[i + 1] if i + 1 < len(instrs) else None
            freed = set(after.names) if isinstance(after, Free) else set()
            gone = [k for k in gone if k[0].node not in freed]
            if gone:
                out.append(Drop(tuple(sorted(gone, key=str))))
    return out


def drop(env: dict[str, tuple], copies: dict[str, dict], items: Iterable[tuple[Ref, object]]
         ) -> None:
    """Run a ``Drop``: an original becomes None (its copies are found first by readers); a
    copy leaves ``copies``."""
    for ref, layout in items:
        if layout is not None:
            have = copies.get(ref.node)
            if have is not None:
                have.pop((ref.index, layout), None)
            continue
        got = env.get(ref.node)
        if got is not None:
            env[ref.node] = tuple(None if k == ref.index else v for k, v in enumerate(got))


__all__ = ["Drop", "drop", "free_copies", "reduce_early"]
