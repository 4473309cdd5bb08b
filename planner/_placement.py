"""Placements in DTensor's vocabulary: how one tensor is laid out along one mesh axis.

``Replicate()``: every rank on the axis holds the whole tensor. ``Shard(dim)``: tensor dimension
``dim`` is split evenly across the axis. ``Partial(op)``: every rank holds a partial value and the
true value is their reduction (sum, or average for mean losses). A placement describes data; it
never communicates. A ``Layout`` is one placement per mesh axis.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Union

from .._errors import PlanError


class ReduceOp(enum.Enum):
    """How the ranks' pieces of a partial value make the whole: their sum, their mean, or
    (``NORM2``) the square root of the sum of their squares, which is what each rank's 2-norm
    of its shard is of the whole's 2-norm (as DTensor's ``_NormPartial``)."""

    SUM = "sum"
    AVG = "avg"
    NORM2 = "norm2"


# (the hashes are written out: the solver hashes layouts millions of times on a 405B graph,
# and a dataclass's own hashes a new tuple of its fields each time)
@dataclass(frozen=True, slots=True)
class Replicate:
    def __str__(self) -> str:
        return "R"

    def __hash__(self) -> int:
        return 1


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int                                  # tensor dim, not mesh axis

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or self.dim < 0:
            raise PlanError(f"Shard needs a non-negative tensor dim, got {self.dim!r}")

    def __str__(self) -> str:
        return f"S({self.dim})"

    def __hash__(self) -> int:
        return 2 + 4 * self.dim


@dataclass(frozen=True, slots=True)
class Partial:
    op: ReduceOp = ReduceOp.SUM

    def __str__(self) -> str:
        return f"P({self.op.value})"

    def __hash__(self) -> int:
        return _PARTIAL_HASH[self.op]


_PARTIAL_HASH = {op: 3 + 4 * i for i, op in enumerate(ReduceOp)}
Placement = Union[Replicate, Shard, Partial]
Layout = tuple[Placement, ...]                 # one placement per mesh axis

R = Replicate()
P_SUM = Partial(ReduceOp.SUM)
P_AVG = Partial(ReduceOp.AVG)
P_NORM2 = Partial(ReduceOp.NORM2)


def parse_placement(text: str) -> Placement:
    """``"R"``, ``"S(1)"``, ``"P(sum)"`` / ``"P(avg)"`` / ``"P(norm2)"`` -> a placement (the
    ``str`` form)."""
    t = text.strip()
    if t == "R":
        return R
    if t.startswith("S(") and t.endswith(")") and t[2:-1].isdigit():
        return Shard(int(t[2:-1]))
    if t.startswith("P(") and t.endswith(")"):
        try:
            return Partial(ReduceOp(t[2:-1]))
        except ValueError:
            pass
    raise PlanError(f"cannot parse placement {text!r}; expected R, S(dim), P(sum), P(avg) or "
                    "P(norm2)")


def format_layout(layout: Layout) -> str:
    return "(" + ", ".join(str(p) for p in layout) + ")"


def shard_factors(layout: Layout, sizes: tuple[int, ...], ndim: int) -> list[int]:
    """Per tensor dim, the number of pieces it is split into by ``layout`` on a mesh of
    ``sizes``."""
    f = [1] * ndim
    for p, n in zip(layout, sizes):
        if isinstance(p, Shard):
            f[p.dim] *= n
    return f


def local_shape(shape: tuple[int, ...], layout: Layout, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The shape each rank holds; PlanError if a sharded dim does not divide evenly."""
    f = shard_factors(layout, sizes, len(shape))
    out = []
    for d, (s, k) in enumerate(zip(shape, f)):
        if s % k:
            raise PlanError(f"dim {d} of size {s} does not divide into {k} shards "
                            f"(layout {format_layout(layout)})")
        out.append(s // k)
    return tuple(out)


@functools.lru_cache(maxsize=1 << 16)
def divides(shape: tuple[int, ...], layout: Layout, sizes: tuple[int, ...]) -> bool:
    if any(isinstance(p, Shard) and p.dim >= len(shape) for p in layout):
        return False
    f = shard_factors(layout, sizes, len(shape))
    return all(s % k == 0 for s, k in zip(shape, f))


def layout_fraction(layout: Layout, sizes: tuple[int, ...]) -> int:
    """How many ways the tensor's bytes are split (Partial and Replicate keep the whole)."""
    k = 1
    for p, n in zip(layout, sizes):
        if isinstance(p, Shard):
            k *= n
    return k
