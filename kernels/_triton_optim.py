"""Fused AdamW and SGD(momentum) updates over lists of local shards, in Triton.

Each shard is updated in place by one fused kernel (one read and one write of each of param,
grad, exp_avg, exp_avg_sq) instead of the ~10 elementwise passes of ``torch.optim``'s
single-tensor path. Scalars (bias corrections, step size) are computed on the host in float64
exactly as ``torch.optim.AdamW(foreach=False)`` does; the elementwise math runs in float32 and
is stored back in each tensor's dtype (state may be float32 while params are float16/bfloat16).

Not done: a single launch over all shards (a pointer table); today it is one launch per shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._common import KernelError, check_tensors

__all__ = ["adamw_step_", "sgd_step_"]

_BLOCK = 1024


@triton.jit
def _adamw(p_ptr, g_ptr, m_ptr, v_ptr, n, lr, decay, beta1, beta2, step_size, bc2_sqrt, eps,
           BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = p * decay
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) / bc2_sqrt + eps
    p = p - step_size * (m / denom)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sgd(p_ptr, g_ptr, b_ptr, n, lr, weight_decay, momentum, dampening, FIRST: tl.constexpr,
         HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr,
         BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
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


def _same_lengths(op: str, **lists: Sequence[torch.Tensor]) -> None:
    lengths = {k: len(v) for k, v in lists.items()}
    if len(set(lengths.values())) != 1:
        raise KernelError(f"{op}: lists differ in length {lengths}; pass one entry per shard")


def _check_shard(op: str, i: int, *ts: torch.Tensor) -> None:
    check_tensors(op, *ts)
    shapes = {tuple(t.shape) for t in ts}
    if len(shapes) != 1:
        raise KernelError(f"{op}: shard {i} has tensors of shapes {sorted(shapes)}; param, grad "
                          "and state of one shard must have one shape")


def adamw_step_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                steps: Sequence[int] | int, *, lr: float, beta1: float = 0.9,
                beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
    """In-place AdamW on every shard; ``steps`` is each shard's step count AFTER the increment
    (torch's ``state['step']`` after ``step += 1``), one int or one per shard."""
    _same_lengths("adamw_step_", params=params, grads=grads, exp_avgs=exp_avgs,
                  exp_avg_sqs=exp_avg_sqs)
    if isinstance(steps, int):
        steps = [steps] * len(params)
    for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
        _check_shard("adamw_step_", i, p, g, m, v)
        if step < 1:
            raise KernelError(f"adamw_step_: shard {i} has step {step}; steps count from 1")
        n = p.numel()
        if not n:
            continue
        step_size = lr / (1 - beta1**step)
        bc2_sqrt = math.sqrt(1 - beta2**step)
        _adamw[(triton.cdiv(n, _BLOCK),)](p, g, m, v, n, lr, 1.0 - lr * weight_decay, beta1,
                                           beta2, step_size, bc2_sqrt, eps, BLOCK=_BLOCK)


def sgd_step_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              momentum_buffers: Sequence[torch.Tensor | None], *, lr: float,
              momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
              nesterov: bool = False, maximize: bool = False) -> list[torch.Tensor | None]:
    """In-place SGD like ``torch.optim.SGD(foreach=False)``; a ``None`` buffer is the first step
    (the buffer is created from the gradient). Returns the momentum buffers."""
    _same_lengths("sgd_step_", params=params, grads=grads, momentum_buffers=momentum_buffers)
    out: list[torch.Tensor | None] = []
    for i, (p, g, buf) in enumerate(zip(params, grads, momentum_buffers)):
        _check_shard("sgd_step_", i, p, g, *(() if buf is None else (buf,)))
        first = buf is None
        if momentum and first:
            buf = torch.empty_like(p)
        n = p.numel()
        if n:
            _sgd[(triton.cdiv(n, _BLOCK),)](p, g, p if buf is None else buf, n, lr, weight_decay,
                                             momentum, dampening, FIRST=first,
                                             HAS_MOMENTUM=momentum != 0, NESTEROV=nesterov,
                                             MAXIMIZE=maximize, BLOCK=_BLOCK)
        out.append(buf if momentum else None)
    return out
