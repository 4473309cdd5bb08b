"""Fused AdamW and SGD(momentum) updates over lists of local shards, in Triton.

Shards are updated in place by a fused kernel (one read and one write of each of param, grad,
exp_avg, exp_avg_sq) instead of the ~10 elementwise passes of ``torch.optim``'s
single-tensor path. Scalars (bias corrections, step size) are computed on the host in float64
as ``torch.optim.AdamW(foreach=False)`` does and reach the kernel as float32; the elementwise
math runs in float32 and is stored back in each tensor's dtype (state may be float32 while
params are float16/bfloat16).

All shards with the same dtypes are updated by ONE launch: a table of the shards' addresses
(int64, cast to pointers in the kernel) and a table of (shard, start) chunks; for AdamW per
group of param/grad/exp_avg/exp_avg_sq dtypes, for SGD per group of param/grad/buffer dtypes
(and first step or not).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._common import KernelError, check_tensors, same_lengths

__all__ = ["adamw_apply_", "adamw_step_", "sgd_step_"]

_BLOCK = 1024


@triton.jit
def _adamw_math(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, decay, beta1, beta2, step_size,
                bc2_sqrt, eps):
    """AdamW's update of one block in fp32 (shared by the per-shard and multi-shard kernels):
    returns the new param, exp_avg and exp_avg_sq."""
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = p * decay
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) / bc2_sqrt + eps
    return p - step_size * (m / denom), m, v


@triton.jit
def _table_chunk(numels_ptr, chunk_tensor_ptr, chunk_start_ptr, BLOCK: tl.constexpr):
    """This program's chunk of a multi-shard launch: the shard's index, the chunk's element
    offsets in it and their mask."""
    c = tl.program_id(0)
    t = tl.load(chunk_tensor_ptr + c)
    offs = tl.load(chunk_start_ptr + c) + tl.arange(0, BLOCK)
    return t, offs, offs < tl.load(numels_ptr + t)


@triton.jit
def _table_ptr(addrs_ptr, k, n_tensors, t, like):
    """Shard ``t``'s ``k``-th tensor (``addrs[k * n_tensors + t]``) as a pointer of ``like``'s
    type."""
    return tl.load(addrs_ptr + k * n_tensors + t).to(like.dtype, bitcast=True)


@triton.jit
def _adamw(p_ptr, g_ptr, m_ptr, v_ptr, n, lr, decay, beta1, beta2, step_size, bc2_sqrt, eps,
           BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p, m, v = _adamw_math(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, decay, beta1, beta2,
                          step_size, bc2_sqrt, eps)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_multi(p_like, g_like, m_like, v_like, addrs_ptr, numels_ptr, chunk_tensor_ptr,
                 chunk_start_ptr, step_size_ptr, bc2_sqrt_ptr, decay, beta1, beta2, eps,
                 n_tensors, BLOCK: tl.constexpr):
    """One program per BLOCK-chunk of any shard: the shard's four addresses come from a table
    (``addrs[k * n_tensors + t]`` for k = param, grad, exp_avg, exp_avg_sq) and are cast to
    pointers of the ``*_like`` arguments' types."""
    t, offs, mask = _table_chunk(numels_ptr, chunk_tensor_ptr, chunk_start_ptr, BLOCK)
    p_ptr = _table_ptr(addrs_ptr, 0, n_tensors, t, p_like)
    g_ptr = _table_ptr(addrs_ptr, 1, n_tensors, t, g_like)
    m_ptr = _table_ptr(addrs_ptr, 2, n_tensors, t, m_like)
    v_ptr = _table_ptr(addrs_ptr, 3, n_tensors, t, v_like)
    step_size = tl.load(step_size_ptr + t)
    bc2_sqrt = tl.load(bc2_sqrt_ptr + t)
    p, m, v = _adamw_math(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, decay, beta1, beta2,
                          step_size, bc2_sqrt, eps)
    tl.store(p_ptr + offs, p.to(p_like.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_like.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_like.dtype.element_ty), mask=mask)


@triton.jit
def _sgd(p_ptr, g_ptr, b_ptr, n, lr, weight_decay, momentum, dampening, FIRST: tl.constexpr,
         HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr,
         BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _sgd_math(p_ptr, g_ptr, b_ptr, offs, offs < n, lr, weight_decay, momentum, dampening,
              FIRST, HAS_MOMENTUM, NESTEROV, MAXIMIZE)


@triton.jit
def _sgd_multi(p_like, g_like, b_like, addrs_ptr, numels_ptr, chunk_tensor_ptr,
               chunk_start_ptr, lr, weight_decay, momentum, dampening, n_tensors,
               FIRST: tl.constexpr, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
               MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr):
    """One program per BLOCK-chunk of any shard, its three addresses (param, grad, buffer)
    read from a table as in ``_adamw_multi``."""
    t, offs, mask = _table_chunk(numels_ptr, chunk_tensor_ptr, chunk_start_ptr, BLOCK)
    p_ptr = _table_ptr(addrs_ptr, 0, n_tensors, t, p_like)
    g_ptr = _table_ptr(addrs_ptr, 1, n_tensors, t, g_like)
    b_ptr = _table_ptr(addrs_ptr, 2, n_tensors, t, b_like)
    _sgd_math(p_ptr, g_ptr, b_ptr, offs, mask, lr, weight_decay, momentum, dampening,
              FIRST, HAS_MOMENTUM, NESTEROV, MAXIMIZE)


@triton.jit
def _sgd_math(p_ptr, g_ptr, b_ptr, offs, mask, lr, weight_decay, momentum, dampening,
              FIRST: tl.constexpr, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
              MAXIMIZE: tl.constexpr):
    """SGD's update of one block in fp32, stored in place (shared by both kernels)."""
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        d = -d
    d = d + weight_decay * p
    if HAS_MOMENTUM:
        if FIRST:
            buf = d
        else:
            buf = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            buf = buf * momentum + (1.0 - dampening) * d
        tl.store(b_ptr + offs, buf.to(b_ptr.dtype.element_ty), mask=mask)
        if NESTEROV:
            d = d + momentum * buf
        else:
            d = buf
    p = p - lr * d
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)


def _check_shard(op: str, i: int, *ts: torch.Tensor) -> None:
    check_tensors(op, *ts)
    shapes = {tuple(t.shape) for t in ts}
    if len(shapes) != 1:
        raise KernelError(f"{op}: shard {i} has tensors of shapes {sorted(shapes)}; param, grad "
                          "and state of one shard must have one shape")


def _dtype_groups(op: str, params, grads, exp_avgs, exp_avg_sqs) -> dict[tuple, list[int]]:
    """Check every shard and group the non-empty ones by their four dtypes (one launch each)."""
    groups: dict[tuple, list[int]] = {}
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        _check_shard(op, i, p, g, m, v)
        if p.numel():
            groups.setdefault((p.dtype, g.dtype, m.dtype, v.dtype), []).append(i)
    return groups


def adamw_step_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                steps: Sequence[int] | int, *, lr: float, beta1: float = 0.9,
                beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2,
                multi_tensor: bool = True) -> None:
    """In-place AdamW on every shard; ``steps`` is each shard's step count AFTER the increment
    (torch's ``state['step']`` after ``step += 1``), one int or one per shard.

    ``multi_tensor`` (default): one launch per group of shards with the same four dtypes, the
    shards' addresses read from a table; otherwise one launch per shard."""
    same_lengths("adamw_step_", params=params, grads=grads, exp_avgs=exp_avgs,
                 exp_avg_sqs=exp_avg_sqs)
    if isinstance(steps, int):
        steps = [steps] * len(params)
    groups = _dtype_groups("adamw_step_", params, grads, exp_avgs, exp_avg_sqs)
    for i, step in enumerate(steps):
        if step < 1:
            raise KernelError(f"adamw_step_: shard {i} has step {step}; steps count from 1")
    scalars = [(lr / (1 - beta1**step), math.sqrt(1 - beta2**step)) for step in steps]
    decay = 1.0 - lr * weight_decay
    for members in groups.values():
        shards = [(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]) for i in members]
        if not multi_tensor:
            for i, (p, g, m, v) in zip(members, shards):
                _adamw[(triton.cdiv(p.numel(), _BLOCK),)](
                    p, g, m, v, p.numel(), lr, decay, beta1, beta2, *scalars[i], eps,
                    BLOCK=_BLOCK)
            continue
        _adamw_group(shards, [scalars[i] for i in members], decay, beta1, beta2, eps)


def adamw_apply_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                 exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                 neg_step_sizes: Sequence[float], bc2_sqrts: Sequence[float], *, decay: float,
                 lerp_weight: float, beta2: float, addcmul_value: float, eps: float) -> None:
    """In-place AdamW from the traced graph's own numbers (what the lowering substitutes):
    per shard the host scalars ``neg_step_size`` (``-lr / bias_correction1``) and
    ``bias_correction2 ** 0.5``; the constants as the graph holds them (``lerp_weight`` =
    1 - beta1, ``addcmul_value`` = 1 - beta2). One launch per dtype group, like
    :func:`adamw_step_`; same arguments as ``kernels._cpu_optim.adamw_fused_cpu_``."""
    same_lengths("adamw_apply_", params=params, grads=grads, exp_avgs=exp_avgs,
                 exp_avg_sqs=exp_avg_sqs, neg_step_sizes=neg_step_sizes, bc2_sqrts=bc2_sqrts)
    del addcmul_value                 # the kernel computes 1 - beta2 itself, in float32
    groups = _dtype_groups("adamw_apply_", params, grads, exp_avgs, exp_avg_sqs)
    for members in groups.values():
        _adamw_group([(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]) for i in members],
                     [(-float(neg_step_sizes[i]), float(bc2_sqrts[i])) for i in members],
                     decay, 1.0 - lerp_weight, beta2, eps)


# (device, addresses, numels) -> the launch tables on the device. Keyed by every shard's address
# and size, so a hit is correct by construction (the tables hold exactly those addresses); a
# training loop updates the same shards every step and builds its tables once.
_TABLES: OrderedDict[tuple, tuple[torch.Tensor, ...]] = OrderedDict()
_TABLES_KEPT = 16


def _launch_tables(shards, device) -> tuple[torch.Tensor, ...]:
    """(addresses [k * n], numels [n], chunk -> shard [c], chunk -> start [c]) on ``device``
    for ``n`` shards of ``k`` tensors each, built with vectorised torch ops on the host and
    moved in ONE copy."""
    numels = [s[0].numel() for s in shards]
    addrs = [s[k].data_ptr() for k in range(len(shards[0])) for s in shards]
    key = (str(device), tuple(addrs), tuple(numels))
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    n = torch.tensor(numels, dtype=torch.int64)
    counts = (n + _BLOCK - 1) // _BLOCK
    chunk_tensor = torch.repeat_interleave(torch.arange(len(numels)), counts)
    first = torch.cumsum(counts, 0) - counts
    chunk_start = (torch.arange(int(counts.sum())) - first[chunk_tensor]) * _BLOCK
    host = torch.cat([torch.tensor(addrs, dtype=torch.int64), n, chunk_tensor, chunk_start])
    on_device = host.to(device)
    sizes = [len(addrs), len(numels), len(chunk_tensor), len(chunk_start)]
    tables = tuple(on_device.split(sizes))
    _TABLES[key] = tables
    if len(_TABLES) > _TABLES_KEPT:
        _TABLES.popitem(last=False)
    return tables


def _adamw_group(shards, scalars, decay, beta1, beta2, eps) -> None:
    device = shards[0][0].device
    table, numels, chunk_tensor, chunk_start = _launch_tables(shards, device)
    # the per-step scalars: one small copy (step sizes, then sqrt(bias_correction2))
    per_shard = torch.tensor([s for s, _ in scalars] + [b for _, b in scalars],
                             dtype=torch.float32).to(device)
    step_sizes, bc2_sqrts = per_shard.split(len(scalars))
    _adamw_multi[(len(chunk_tensor),)](
        *shards[0], table, numels, chunk_tensor, chunk_start, step_sizes, bc2_sqrts, decay,
        beta1, beta2, eps, len(shards), BLOCK=_BLOCK)


def sgd_step_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              momentum_buffers: Sequence[torch.Tensor | None], *, lr: float,
              momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
              nesterov: bool = False, maximize: bool = False,
              multi_tensor: bool = True) -> list[torch.Tensor | None]:
    """In-place SGD like ``torch.optim.SGD(foreach=False)``; a ``None`` buffer is the first step
    (the buffer is created from the gradient). Returns the momentum buffers.

    ``multi_tensor`` (default): one launch per group of shards with the same dtypes (and the
    same first step or not), the shards' addresses read from a table; otherwise one launch per
    shard."""
    same_lengths("sgd_step_", params=params, grads=grads, momentum_buffers=momentum_buffers)
    out: list[torch.Tensor | None] = []
    groups: dict[tuple, list[tuple[torch.Tensor, ...]]] = {}
    for i, (p, g, buf) in enumerate(zip(params, grads, momentum_buffers)):
        _check_shard("sgd_step_", i, p, g, *(() if buf is None else (buf,)))
        first = buf is None
        if momentum and first:
            buf = torch.empty_like(p)
        out.append(buf if momentum else None)
        if p.numel():                 # without momentum the buffer slot is the param (unread)
            shard = (p, g, p if buf is None else buf)
            groups.setdefault((first, *(t.dtype for t in shard)), []).append(shard)
    flags = dict(HAS_MOMENTUM=momentum != 0, NESTEROV=nesterov, MAXIMIZE=maximize,
                 BLOCK=_BLOCK)
    for (first, *_), shards in groups.items():
        if not multi_tensor:
            for p, g, buf in shards:
                _sgd[(triton.cdiv(p.numel(), _BLOCK),)](p, g, buf, p.numel(), lr, weight_decay,
                                                         momentum, dampening, FIRST=first,
                                                         **flags)
            continue
        table, numels, chunk_tensor, chunk_start = _launch_tables(shards, shards[0][0].device)
        _sgd_multi[(len(chunk_tensor),)](*shards[0], table, numels, chunk_tensor, chunk_start,
                                         lr, weight_decay, momentum, dampening, len(shards),
                                         FIRST=first, **flags)
    return out
