"""CPU kernels (numba) for gradient buckets: flatten many tensors into one buffer and back.

``flatten_into(buffer, tensors, offsets)`` copies tensor ``i`` (any strides, up to 4 dims,
flattened in row-major order) to ``buffer[offsets[i] : offsets[i] + numel_i]``;
``unflatten_from(buffer, tensors, offsets)`` copies the ranges back into the tensors (in
place, through their strides). ``pack_strided(views, out)`` / ``unpack_strided(buffer, views)``
are the same copies at consecutive offsets (strided shard packing). Each has a pure-torch twin
in :mod:`._flatten_torch` with the same signature and identical results.

How: the tensors are passed to one ``@njit(parallel=True)`` function as a table of addresses,
sizes and element strides (no per-tensor numpy views, no typed lists). The work is cut into
chunks of ``CHUNK`` elements and spread over threads with ``prange``, so one large embedding
gradient does not serialise the copy. Contiguous runs (whole contiguous tensors, and each row
of a view whose last dim has stride 1) are ``memcpy``s; other elements move one at a time as
unsigned integers of the dtype's width. Either way every dtype (bfloat16, bool, complex64
too) is copied bit-exactly. The first call compiles (a few seconds; cached on disk after).
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np
import torch
from llvmlite import ir as llvm_ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._common import KernelError

__all__ = ["flatten_into", "unflatten_from", "pack_strided", "unpack_strided", "CHUNK"]

CHUNK = 1 << 16  # elements per parallel work item
_DIMS = 4
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@intrinsic
def _as_pointer(typingctx, address, like):
    """``(int64 address, array)`` -> a pointer to the array's element type at that address."""
    ptr_t = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr_t))

    return ptr_t(address, like), codegen


@intrinsic
def _memcpy(typingctx, dst, src, nbytes):
    """memcpy between two int64 addresses."""

    def codegen(context, builder, signature, args):
        byte_ptr = llvm_ir.IntType(8).as_pointer()
        dst_p, src_p = (builder.inttoptr(a, byte_ptr) for a in args[:2])
        cgutils.raw_memcpy(builder, dst_p, src_p, args[2], 1)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64), codegen


@numba.njit(inline="always")
def _copy_run(buffer, ptr, at, step, base, count, to_buffer, buf_addr, t_addr, width):
    """``count`` elements: ``buffer[base:]`` <-> ``ptr[at], ptr[at + step], ...``."""
    if step == 1:
        here, there = buf_addr + base * width, t_addr + at * width
        if to_buffer:
            _memcpy(here, there, count * width)
        else:
            _memcpy(there, here, count * width)
    elif to_buffer:
        for j in range(count):
            buffer[base + j] = ptr[at + j * step]
    else:
        for j in range(count):
            ptr[at + j * step] = buffer[base + j]


@numba.njit(parallel=True, cache=True, nogil=True)
def _copy_table(buffer, addrs, geometry, offsets, chunk_tensor, chunk_start, to_buffer,
                buf_addr):
    """Copy chunk ``c`` of tensor ``chunk_tensor[c]`` between its strided storage and buffer.

    geometry[i] = (numel, s1, s2, s3, t0, t1, t2, t3, contiguous) in elements. A strided chunk
    is walked row by row along the last dim (one index decomposition per chunk, not per element).
    """
    width = buffer.itemsize
    for c in numba.prange(chunk_tensor.shape[0]):
        i = chunk_tensor[c]
        k = chunk_start[c]
        stop = min(k + CHUNK, geometry[i, 0])
        ptr = _as_pointer(addrs[i], buffer)
        base = offsets[i]
        if geometry[i, 8] == 1:
            _copy_run(buffer, ptr, k, 1, base + k, stop - k, to_buffer, buf_addr, addrs[i], width)
            continue
        s1, s2, s3 = geometry[i, 1], geometry[i, 2], geometry[i, 3]
        t0, t1, t2, t3 = geometry[i, 4], geometry[i, 5], geometry[i, 6], geometry[i, 7]
        i3 = k % s3
        r = k // s3
        i2 = r % s2
        r //= s2
        i1 = r % s1
        i0 = r // s1
        while k < stop:
            count = min(s3 - i3, stop - k)
            at = i0 * t0 + i1 * t1 + i2 * t2 + i3 * t3
            _copy_run(buffer, ptr, at, t3, base + k, count, to_buffer, buf_addr, addrs[i], width)
            k += count
            i3 = 0
            i2 += 1
            if i2 == s2:
                i2 = 0
                i1 += 1
                if i1 == s1:
                    i1 = 0
                    i0 += 1


def _table(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]):
    if len(tensors) != len(offsets):
        raise KernelError(f"flatten: {len(tensors)} tensors but {len(offsets)} offsets")
    if buffer.dim() != 1 or not buffer.is_contiguous() or buffer.device.type != "cpu":
        raise KernelError(f"flatten: buffer must be a contiguous 1-D CPU tensor, got shape "
                          f"{tuple(buffer.shape)} on {buffer.device}")
    count = len(tensors)
    addrs = np.empty(count, dtype=np.int64)
    geometry = np.zeros((count, 9), dtype=np.int64)
    tensor_of, start_of = [], []
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        _check_one(i, t, off, buffer)
        if t.dim() > _DIMS and not t.is_contiguous():
            raise KernelError(f"flatten: tensor {i} is a non-contiguous view with {t.dim()} dims; "
                              f"the kernel walks up to {_DIMS}; pass .contiguous() or merge dims")
        n = t.numel()
        shape = [1] * (_DIMS - min(t.dim(), _DIMS)) + list(t.shape[-_DIMS:] if t.dim() else [])
        strides = [0] * (_DIMS - min(t.dim(), _DIMS)) + list(t.stride()[-_DIMS:] if t.dim() else [])
        addrs[i] = t.data_ptr()
        geometry[i] = [n, shape[1], shape[2], shape[3], *strides, int(t.is_contiguous())]
        starts = range(0, n, CHUNK)
        tensor_of += [i] * len(starts)
        start_of += starts
    return addrs, geometry, np.asarray(tensor_of, np.int64), np.asarray(start_of, np.int64)


def _check_one(i: int, t: torch.Tensor, off: int, buffer: torch.Tensor) -> None:
    if t.dtype != buffer.dtype or t.device != buffer.device:
        raise KernelError(f"flatten: tensor {i} is {t.dtype} on {t.device} but the buffer is "
                          f"{buffer.dtype} on {buffer.device}; use one buffer per dtype "
                          "(plan_buckets makes them)")
    if off < 0 or off + t.numel() > buffer.numel():
        raise KernelError(f"flatten: tensor {i} ({t.numel()} elements at offset {off}) does not "
                          f"fit in a buffer of {buffer.numel()} elements")


def _as_ints(buffer: torch.Tensor) -> np.ndarray:
    width = buffer.element_size()
    if width not in _INT_OF_SIZE:
        raise KernelError(f"flatten: dtype {buffer.dtype} ({width} bytes) is not supported; "
                          "use the torch fallback (flatten_into_torch)")
    return buffer.view(_INT_OF_SIZE[width]).numpy()


def _run(buffer, tensors, offsets, to_buffer: bool) -> None:
    if not tensors:
        return
    addrs, geometry, tensor_of, start_of = _table(buffer, tensors, offsets)
    _copy_table(_as_ints(buffer), addrs, geometry, np.asarray(offsets, np.int64), tensor_of,
                start_of, to_buffer, buffer.data_ptr())


def flatten_into(buffer: torch.Tensor, tensors: Sequence[torch.Tensor],
                 offsets: Sequence[int]) -> torch.Tensor:
    """Copy each tensor (row-major) into ``buffer[offsets[i]:]``; returns ``buffer``."""
    _run(buffer, tensors, offsets, True)
    return buffer


def unflatten_from(buffer: torch.Tensor, tensors: Sequence[torch.Tensor],
                   offsets: Sequence[int]) -> None:
    """Copy ``buffer[offsets[i]:]`` back into each tensor, in place through its strides."""
    _run(buffer, tensors, offsets, False)


def _consecutive(views: Sequence[torch.Tensor]) -> list[int]:
    offsets, at = [], 0
    for v in views:
        offsets.append(at)
        at += v.numel()
    return offsets


def pack_strided(views: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Strided shard packing: the views (e.g. ``narrow`` shards) back to back in one buffer."""
    if out is None:
        out = torch.empty(sum(v.numel() for v in views), dtype=views[0].dtype)
    return flatten_into(out, views, _consecutive(views))


def unpack_strided(buffer: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
    """Inverse of :func:`pack_strided`: scatter consecutive ranges back through the views."""
    unflatten_from(buffer, views, _consecutive(views))
