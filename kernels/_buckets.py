"""Gradient bucket planning: which tensors share one flat buffer and one collective.

``plan_buckets(sizes_bytes, dtypes, bucket_bytes)`` walks the tensors in the given order (the
caller passes them in the order their gradients become ready - usually reverse parameter
order - as DDP does), keeps one open bucket per dtype, and closes a bucket when the next tensor
would take it above ``bucket_bytes``. A single tensor larger than ``bucket_bytes`` gets a
bucket of its own (DDP's ``bucket_cap_mb`` rule). Buckets come out in the order they are
opened (the order of their first tensor). Offsets are in elements of the bucket's dtype, ready
for ``flatten_into(buffer, tensors, bucket.offsets)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._common import KernelError

__all__ = ["Bucket", "plan_buckets", "dtype_name"]

_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
}


@dataclass(frozen=True, slots=True)
class Bucket:
    """Tensors ``indices`` (positions in the planned list) packed at element ``offsets``."""

    dtype: str
    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int

    def __post_init__(self) -> None:
        if len(self.indices) != len(self.offsets) or not self.indices:
            raise KernelError(f"Bucket needs one offset per tensor and at least one tensor, got "
                              f"indices={self.indices} offsets={self.offsets}")

    @property
    def nbytes(self) -> int:
        return self.numel * _ITEMSIZE[self.dtype]

    def buffer(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """A fresh flat buffer for this bucket."""
        return torch.empty(self.numel, dtype=getattr(torch, self.dtype), device=device)


def dtype_name(dtype: str | torch.dtype) -> str:
    """``torch.float32`` or ``"float32"`` -> ``"float32"`` (the IR's dtype names)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _ITEMSIZE:
        raise KernelError(f"unknown dtype {dtype!r}; buckets know {sorted(_ITEMSIZE)}")
    return name


def plan_buckets(sizes_bytes: Sequence[int], dtypes: Sequence[str | torch.dtype],
                 bucket_bytes: int) -> list[Bucket]:
    """Group tensors into per-dtype buckets of at most ``bucket_bytes`` (see module docstring)."""
    if len(sizes_bytes) != len(dtypes):
        raise KernelError(f"plan_buckets: {len(sizes_bytes)} sizes but {len(dtypes)} dtypes")
    if bucket_bytes <= 0:
        raise KernelError(f"plan_buckets: bucket_bytes must be positive, got {bucket_bytes}")
    opened: list[list] = []          # [dtype, indices, offsets, bytes] in opening order
    current: dict[str, list] = {}
    for i, (size, dtype) in enumerate(zip(sizes_bytes, dtypes)):
        name = dtype_name(dtype)
        item = _ITEMSIZE[name]
        if size < 0 or size % item:
            raise KernelError(f"plan_buckets: tensor {i} has {size} bytes, not a whole number "
                              f"of {name} elements")
        open_ = current.get(name)
        if open_ is None or (open_[3] and open_[3] + size > bucket_bytes):
            open_ = current[name] = [name, [], [], 0]
            opened.append(open_)
        open_[1].append(i)
        open_[2].append(open_[3] // item)
        open_[3] += size
    return [Bucket(d, tuple(ix), tuple(off), b // _ITEMSIZE[d]) for d, ix, off, b in opened]
