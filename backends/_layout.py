"""Where a rank sits on the mesh and which piece of a tensor it holds.

Ranks are numbered row-major over the mesh axes (axis 0 outermost). A dim sharded by several
axes is split mixed-radix in axis order, the first axis outermost: on ``{"dp": 2, "tp": 2}``,
``(S(0), S(0))`` gives rank ``(dp=i, tp=j)`` piece ``2 * i + j`` of four. This is DTensor's
convention, and the lowering keeps every redistribution consistent with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .._errors import LoweringError
from ..planner import Layout, Partial, ReduceOp, Replicate, Shard


def rank_coords(rank: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(sizes):
        out.append(rank % n)
        rank //= n
    return tuple(reversed(out))


def coords_rank(coords: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    r = 0
    for c, n in zip(coords, sizes):
        r = r * n + c
    return r


def axis_group(coords: tuple[int, ...], axis: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The ranks that differ from ``coords`` only along ``axis``, in axis order."""
    return tuple(coords_rank(coords[:axis] + (i,) + coords[axis + 1:], sizes)
                 for i in range(sizes[axis]))


def all_axis_groups(sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every axis group of the mesh, in one order all ranks agree on."""
    seen: dict[tuple[int, ...], None] = {}
    world = math.prod(sizes)
    for axis in range(len(sizes)):
        for r in range(world):
            g = axis_group(rank_coords(r, sizes), axis, sizes)
            if len(g) > 1:
                seen.setdefault(g, None)
    return list(seen)


def piece(layout: Layout, sizes: tuple[int, ...], coords: tuple[int, ...],
          dim: int) -> tuple[int, int]:
    """(index, count) of the piece of ``dim`` this rank holds."""
    index, count = 0, 1
    for p, n, c in zip(layout, sizes, coords):
        if isinstance(p, Shard) and p.dim == dim:
            index, count = index * n + c, count * n
    return index, count


def local_slices(shape: Sequence[int], layout: Layout, sizes: tuple[int, ...],
                 coords: tuple[int, ...]) -> tuple[slice, ...]:
    """Where the piece of a whole tensor of ``shape`` that the rank at ``coords`` holds under
    ``layout`` lies in it: one slice per dim (Partial axes aside, see ``local_part``)."""
    out = []
    for dim, n in enumerate(shape):
        index, count = piece(layout, sizes, coords, dim)
        if n % count:
            raise LoweringError(f"dim {dim} of shape {list(shape)} does not split into "
                                f"{count} pieces; use a size the mesh divides")
        step = n // count
        out.append(slice(index * step, (index + 1) * step))
    return tuple(out)


def local_part(full: Tensor, layout: Layout, sizes: tuple[int, ...],
               coords: tuple[int, ...]) -> Tensor:
    """The piece of a whole tensor that the rank at ``coords`` holds under ``layout``
    (a Partial(sum) axis: coordinate 0 holds the value, the others zeros)."""
    out = full[local_slices(full.shape, layout, sizes, coords)]
    if holds_zeros(layout, coords):
        out = torch.zeros_like(out)
    return out.contiguous()


def holds_zeros(layout: Layout, coords: tuple[int, ...]) -> bool:
    """Whether the rank at ``coords`` holds zeros of a whole value under ``layout`` (it is not
    coordinate 0 of a Partial(sum) or Partial(norm2) axis)."""
    return any(isinstance(p, Partial) and p.op is not ReduceOp.AVG and c != 0
               for p, c in zip(layout, coords))


def assemble(parts: dict[tuple[int, ...], Tensor], layout: Layout,
             sizes: tuple[int, ...]) -> Tensor:
    """The whole tensor from every rank's piece (``parts``: coords -> piece); Replicate and
    Partial axes read coordinate 0 (state and results are never Partial)."""
    if any(isinstance(p, Partial) for p in layout):
        raise LoweringError(f"cannot assemble a partial value (layout {layout})")
    sharded = [a for a, p in enumerate(layout) if isinstance(p, Shard)]
    zero = tuple(0 for _ in sizes)
    if not sharded:
        return parts[zero]
    sample = parts[zero]
    ndim = sample.dim()
    grids: dict[tuple[int, ...], Tensor] = {}
    for coords, t in parts.items():
        if any(c != 0 for a, c in enumerate(coords) if a not in sharded):
            continue
        key = tuple(piece(layout, sizes, coords, d)[0] for d in range(ndim))
        grids[key] = t
    counts = [piece(layout, sizes, zero, d)[1] for d in range(ndim)]
    return _stitch(grids, counts, 0, ())


def _stitch(grids: dict[tuple[int, ...], Tensor], counts: list[int], dim: int,
            prefix: tuple[int, ...]) -> Tensor:
    if dim == len(counts):
        return grids[prefix]
    return torch.cat([_stitch(grids, counts, dim + 1, prefix + (i,))
                      for i in range(counts[dim])], dim=dim)


def is_replicate(layout: Layout) -> bool:
    return all(isinstance(p, Replicate) for p in layout)


def plain_layout(layout: Layout, sizes: tuple[int, ...]) -> Layout:
    """``layout`` with every placement on an axis of size 1 written as Replicate: there they
    all mean the same piece, the whole value (a solver may pick any of them)."""
    return tuple(Replicate() if n == 1 else p for p, n in zip(layout, sizes))


__all__ = ["all_axis_groups", "assemble", "axis_group", "coords_rank", "is_replicate",
           "local_part", "piece", "plain_layout", "rank_coords"]
