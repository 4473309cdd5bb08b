"""Pure-torch twins of the numba bucket kernels: same signatures, identical results, any device.

Used where numba is missing, on CUDA tensors, and as the reference the numba kernels are
tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._common import KernelError

__all__ = ["flatten_into_torch", "unflatten_from_torch", "pack_strided_torch",
           "unpack_strided_torch"]


def _check(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    if len(tensors) != len(offsets):
        raise KernelError(f"flatten: {len(tensors)} tensors but {len(offsets)} offsets")
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        if t.dtype != buffer.dtype:
            raise KernelError(f"flatten: tensor {i} is {t.dtype} but the buffer is {buffer.dtype};"
                              " use one buffer per dtype (plan_buckets makes them)")
        if off < 0 or off + t.numel() > buffer.numel():
            raise KernelError(f"flatten: tensor {i} ({t.numel()} elements at offset {off}) does "
                              f"not fit in a buffer of {buffer.numel()} elements")


def flatten_into_torch(buffer: torch.Tensor, tensors: Sequence[torch.Tensor],
                       offsets: Sequence[int]) -> torch.Tensor:
    _check(buffer, tensors, offsets)
    if _consecutive_from_zero(tensors, offsets):
        total = sum(t.numel() for t in tensors)
        torch.cat([t.reshape(-1) for t in tensors], out=buffer[:total])
        return buffer
    for t, off in zip(tensors, offsets):
        buffer[off:off + t.numel()].view(t.shape).copy_(t)
    return buffer


def unflatten_from_torch(buffer: torch.Tensor, tensors: Sequence[torch.Tensor],
                         offsets: Sequence[int]) -> None:
    _check(buffer, tensors, offsets)
    for t, off in zip(tensors, offsets):
        t.copy_(buffer[off:off + t.numel()].view(t.shape))


def _consecutive_from_zero(tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> bool:
    at = 0
    for t, off in zip(tensors, offsets):
        if off != at:
            return False
        at += t.numel()
    return bool(tensors)


def pack_strided_torch(views: Sequence[torch.Tensor],
                       out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        out = torch.empty(sum(v.numel() for v in views), dtype=views[0].dtype,
                          device=views[0].device)
    at = 0
    for v in views:  # one strided copy per view, no temporary
        out[at:at + v.numel()].view(v.shape).copy_(v)
        at += v.numel()
    return out


def unpack_strided_torch(buffer: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
    at = 0
    for v in views:
        v.copy_(buffer[at:at + v.numel()].view(v.shape))
        at += v.numel()
