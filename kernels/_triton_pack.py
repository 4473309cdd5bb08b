"""Gather strided shards into one contiguous buffer and scatter them back, in Triton.

``pack_views(views, out=None)`` copies each view (any strides, up to 4 dims; e.g. a
``narrow`` of a sharded dim, a transposed slice) into consecutive ranges of one flat buffer;
``unpack_views(buffer, views)`` writes the ranges back through the views, so the storage the
views alias is updated in place. One launch per view; the flat index is decomposed into the
view's 4-D index inside the kernel, so no ``.contiguous()`` copy is made. Works for any dtype
Triton can load (float32/float16/bfloat16, ints).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._common import KernelError, interpreting

__all__ = ["pack_views", "unpack_views", "narrow_shards"]

_BLOCK = 1024
_MAX_DIMS = 4


@triton.jit
def _copy(src_ptr, dst_ptr, n, s1, s2, s3, t0, t1, t2, t3, SCATTER: tl.constexpr,
          BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    i3 = offs % s3
    r = offs // s3
    i2 = r % s2
    r = r // s2
    i1 = r % s1
    i0 = r // s1
    strided = i0 * t0 + i1 * t1 + i2 * t2 + i3 * t3
    if SCATTER:   # src: flat buffer -> dst: strided view
        x = tl.load(src_ptr + offs, mask=mask)
        tl.store(dst_ptr + strided, x, mask=mask)
    else:         # src: strided view -> dst: flat buffer
        x = tl.load(src_ptr + strided, mask=mask)
        tl.store(dst_ptr + offs, x, mask=mask)


def _geometry(v: torch.Tensor) -> tuple[list[int], list[int]]:
    if v.dim() > _MAX_DIMS:
        raise KernelError(f"pack_views: a view of {v.dim()} dims (shape {tuple(v.shape)}); the "
                          f"kernel handles up to {_MAX_DIMS}; merge dims with .flatten() first")
    pad = _MAX_DIMS - v.dim()
    return [1] * pad + list(v.shape), [0] * pad + list(v.stride())


def _launch(flat: torch.Tensor, view: torch.Tensor, scatter: bool) -> None:
    n = view.numel()
    if not n:
        return
    shape, strides = _geometry(view)
    src, dst = (flat, view) if scatter else (view, flat)
    _copy[(triton.cdiv(n, _BLOCK),)](src, dst, n, shape[1], shape[2], shape[3], *strides,
                                     SCATTER=scatter, BLOCK=_BLOCK)


def _check(views: Sequence[torch.Tensor], buffer: torch.Tensor | None) -> None:
    tensors = list(views) + ([] if buffer is None else [buffer])
    if len({t.dtype for t in tensors}) > 1 or len({t.device for t in tensors}) > 1:
        raise KernelError("pack_views: views and buffer must share one dtype and device; pack "
                          "each dtype into its own buffer (plan_buckets groups them)")
    if tensors and tensors[0].device.type == "cpu" and not interpreting():
        raise KernelError("pack_views: CPU tensors need TRITON_INTERPRET=1; on CPU use "
                          "meshplan.kernels.pack_strided (numba)")


def pack_views(views: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate the (possibly non-contiguous) views, flattened, into one 1-D buffer."""
    _check(views, out)
    if out is None:
        out = torch.empty(sum(v.numel() for v in views), dtype=views[0].dtype,
                          device=views[0].device)
    _through(out, views, scatter=False, what="pack_views: out")
    return out


def unpack_views(buffer: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
    """Write consecutive ranges of ``buffer`` back through each view (in place)."""
    _check(views, buffer)
    _through(buffer, views, scatter=True, what="unpack_views: buffer")


def _through(buffer: torch.Tensor, views: Sequence[torch.Tensor], *, scatter: bool,
             what: str) -> None:
    """Copy between consecutive ranges of the 1-D ``buffer`` and ``views``, in order."""
    total = sum(v.numel() for v in views)
    if buffer.dim() != 1 or not buffer.is_contiguous() or buffer.numel() < total:
        raise KernelError(f"{what} must be a contiguous 1-D buffer of at least {total} "
                          f"elements, got shape {tuple(buffer.shape)}")
    offset = 0
    for v in views:
        _launch(buffer[offset:offset + v.numel()], v, scatter=scatter)
        offset += v.numel()


def narrow_shards(t: torch.Tensor, dim: int, parts: int) -> list[torch.Tensor]:
    """The ``parts`` views of ``t`` split evenly along tensor dim ``dim`` (like ``Shard(dim)``)."""
    if t.shape[dim] % parts:
        raise KernelError(f"narrow_shards: dim {dim} of size {t.shape[dim]} does not split into "
                          f"{parts} equal shards")
    size = t.shape[dim] // parts
    return [t.narrow(dim, k * size, size) for k in range(parts)]
